// ftemu.h: run CUDA kernels on the host, for CI machines without a GPU.
//
// The emu device force-includes this header before a kernel source and compiles the result with g++.
// Each block's threads are fibers on one OS thread (blocks run on a few worker threads); a fiber runs
// until it blocks in __syncthreads or a warp collective, so warps are NOT implicitly synchronous: code
// that forgets a barrier or a sync mask behaves differently here, and misuse is reported, never hung on.
//
// Design notes:
//  * __shared__ variables become `thread_local` (static storage at block scope), so all fibers of the
//    block running on one worker see one copy. `extern __shared__` is rewritten by the Python builder into
//    a pointer to the block's dynamic shared memory.
//  * Nothing defines __CUDA_ARCH__: sources take their portable path, as the DESIGN asks of every kernel.
//  * Errors (divergent barriers, mismatched masks, bad launches) abort the launch and come back to Python
//    as a message naming the kernel, the block and the thread.
#pragma once
#define FTEMU 1

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

// ---- qualifiers (defined before the CUDA headers so host_defines.h keeps ours) ----------------------
#ifndef __ftemu_preprocess_only__
#define __global__
#define __shared__ thread_local
#define __launch_bounds__(...)
#endif
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __grid_constant__
#define __noinline__ __attribute__((noinline))
#define __forceinline__ inline __attribute__((always_inline))

#include <vector_types.h>
#include <vector_functions.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;

namespace ftemu {

enum class St : uint8_t { Ready, Barrier, Warp, Done };

enum WarpOp : int {
  W_SYNC = 1, W_SHFL, W_SHFL_UP, W_SHFL_DOWN, W_SHFL_XOR, W_BALLOT, W_ANY, W_ALL, W_MATCH_ANY,
  W_REDUCE_ADD, W_REDUCE_MIN, W_REDUCE_MAX, W_REDUCE_UMIN, W_REDUCE_UMAX, W_REDUCE_AND, W_REDUCE_OR,
  W_REDUCE_XOR
};

inline const char* warp_op_name(int op) {
  static const char* names[] = {"?", "__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                "__shfl_xor_sync", "__ballot_sync", "__any_sync", "__all_sync",
                                "__match_any_sync", "__reduce_add_sync", "__reduce_min_sync",
                                "__reduce_max_sync", "__reduce_min_sync", "__reduce_max_sync",
                                "__reduce_and_sync", "__reduce_or_sync", "__reduce_xor_sync"};
  return (op > 0 && op <= W_REDUCE_XOR) ? names[op] : "?";
}

struct Block;

struct Fiber {
  void* sp = nullptr;      // saved stack pointer while switched out
  char* stack_lo = nullptr;
  size_t stack_size = 0;
  uint3 tid{};
  int linear = 0, lane = 0, warp = 0;
  St st = St::Ready;
  // __syncthreads bookkeeping
  const char* bar_file = nullptr;
  int bar_line = 0, bar_pred = 0, bar_kind = 0, bar_res = 0;
  // warp collective bookkeeping
  int wop = 0, warg = 0, wwidth = 32;
  unsigned wmask = 0;
  uint64_t wval = 0, wres = 0;
  Block* block = nullptr;
};

struct Block {
  const char* kernel = "";
  uint3 bid{};
  dim3 bdim, gdim;
  int nthreads = 0, n_done = 0;
  Fiber* fibers = nullptr;
  void* sched_sp = nullptr;
  const void* sched_stack_lo = nullptr;
  size_t sched_stack_size = 0;
  char* dyn_smem = nullptr;
  size_t dyn_size = 0;
  void (*entry)(const void*) = nullptr;
  const void* entry_ctx = nullptr;
  bool failed = false;
  std::string err;
};

inline thread_local Fiber* g_cur = nullptr;
inline thread_local Block* g_block = nullptr;

// ---- context switch -----------------------------------------------------------------------------------
#if defined(__x86_64__)
extern "C" void ftemu_ctx_switch(void** save_sp, void* load_sp);
// Saves callee-saved registers plus MXCSR and the x87 control word on the current stack, stores the
// stack pointer in *save_sp, then restores the same from load_sp and returns on that stack.
asm(R"(
.text
.p2align 4
.globl ftemu_ctx_switch
.hidden ftemu_ctx_switch
.type ftemu_ctx_switch,@function
ftemu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size ftemu_ctx_switch,.-ftemu_ctx_switch
.section .note.GNU-stack,"",@progbits
.text
)");

void fiber_main();

inline void* init_stack(char* lo, size_t size) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(lo) + size) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                               // fake return address of fiber_main
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);         // `ret` lands here
  for (int i = 0; i < 6; ++i) *--sp = 0;                   // rbp rbx r12 r13 r14 r15
  *--sp = 0x1F80ull | (0x037Full << 32);                    // mxcsr | x87 control word
  return sp;
}
inline void raw_switch(void** save, void* load) { ftemu_ctx_switch(save, load); }
#else
#error "the emu device needs x86_64 for its fiber switch; port ftemu_ctx_switch to this architecture"
#endif

// Switch with AddressSanitizer told about the stack change (otherwise it reports false positives).
inline void switch_to(void** save, void* load, const void* to_lo, size_t to_size) {
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, to_lo, to_size);
  raw_switch(save, load);
  const void* old_lo;
  size_t old_size;
  __sanitizer_finish_switch_fiber(fake, &old_lo, &old_size);
  if (g_block && !g_block->sched_stack_lo) {
    g_block->sched_stack_lo = old_lo;
    g_block->sched_stack_size = old_size;
  }
#else
  (void)to_lo;
  (void)to_size;
  raw_switch(save, load);
#endif
}

inline void yield_to_scheduler() {
  Fiber* f = g_cur;
  Block* b = f->block;
  switch_to(&f->sp, b->sched_sp, b->sched_stack_lo, b->sched_stack_size);
}

[[noreturn]] inline void fail_in_fiber(const std::string& msg) {
  Fiber* f = g_cur;
  Block* b = f->block;
  if (!b->failed) {
    b->failed = true;
    char where[160];
    snprintf(where, sizeof where, " [block (%u,%u,%u), thread (%u,%u,%u)]", b->bid.x, b->bid.y, b->bid.z,
             f->tid.x, f->tid.y, f->tid.z);
    b->err = msg + where;
  }
  f->st = St::Done;
  for (;;) yield_to_scheduler();
}

inline void fiber_main() {
#if defined(__SANITIZE_ADDRESS__)
  const void* old_lo;
  size_t old_size;
  __sanitizer_finish_switch_fiber(nullptr, &old_lo, &old_size);
  if (!g_block->sched_stack_lo) {
    g_block->sched_stack_lo = old_lo;
    g_block->sched_stack_size = old_size;
  }
#endif
  Fiber* f = g_cur;
  Block* b = f->block;
  b->entry(b->entry_ctx);
  f->st = St::Done;
  b->n_done++;
  for (;;) yield_to_scheduler();
}

// ---- fiber stacks ---------------------------------------------------------------------------------------
// Stacks are mmap'ed (committed lazily) and recycled across launches. A stack gets its guard page (below it) when a
// block first needs that many threads, not when the arena is mapped: each guard page splits the mapping, and a
// process may hold only vm.max_map_count (65530 by default) mappings in all. Every emu module has its own arenas
// (one per worker), so guarding all 1024 stacks of each took 2048 mappings per arena: a test process with a few
// dozen modules loaded ran out, and the next mmap anywhere (Numba's JIT, malloc) failed.
constexpr size_t kStackSize = size_t(256) << 10;
constexpr int kMaxThreads = 1024;

struct Arena {
  char* base = nullptr;
  size_t per = 0;
  int guarded = 0;  // stacks 0 .. guarded - 1 have their guard page
  Fiber fibers[kMaxThreads];
};

// Guard pages for the first n stacks of the arena (those a block of n threads runs on).
inline void guard_stacks(Arena& a, int n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (; a.guarded < n; ++a.guarded) mprotect(a.base + a.per * a.guarded, page, PROT_NONE);
}

inline std::mutex g_arena_mu;
inline std::vector<Arena*> g_arenas;

inline Arena* get_arena() {
  {
    std::lock_guard<std::mutex> lk(g_arena_mu);
    if (!g_arenas.empty()) {
      Arena* a = g_arenas.back();
      g_arenas.pop_back();
      return a;
    }
  }
  long page = sysconf(_SC_PAGESIZE);
  size_t per = kStackSize + size_t(page);
  char* base = static_cast<char*>(mmap(nullptr, per * kMaxThreads, PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (base == MAP_FAILED) return nullptr;
  Arena* a = new Arena();
  a->base = base;
  a->per = per;
  for (int i = 0; i < kMaxThreads; ++i) {  // the guard page below each stack: guard_stacks, when first used
    a->fibers[i].stack_lo = base + per * i + page;
    a->fibers[i].stack_size = kStackSize;
  }
  return a;
}

inline void put_arena(Arena* a) {
  std::lock_guard<std::mutex> lk(g_arena_mu);
  g_arenas.push_back(a);
}

// ---- block scheduler ------------------------------------------------------------------------------------
inline std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
inline std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

inline void block_fail(Block& b, const std::string& msg) {
  if (b.failed) return;
  b.failed = true;
  b.err = msg + fmt(" [block (%u,%u,%u)]", b.bid.x, b.bid.y, b.bid.z);
}

// All non-exited threads are blocked: release a __syncthreads or report why the block cannot proceed.
inline void resolve_stall(Block& b) {
  int n_bar = 0, n_warp = 0;
  Fiber* first_bar = nullptr;
  Fiber* first_warp = nullptr;
  for (int i = 0; i < b.nthreads; ++i) {
    Fiber& f = b.fibers[i];
    if (f.st == St::Barrier) {
      n_bar++;
      if (!first_bar) first_bar = &f;
    } else if (f.st == St::Warp) {
      n_warp++;
      if (!first_warp) first_warp = &f;
    }
  }
  if (n_bar == b.nthreads) {
    int count = 0, all = 1, any = 0;
    for (int i = 0; i < b.nthreads; ++i) {
      Fiber& f = b.fibers[i];
      if (f.bar_line != first_bar->bar_line || strcmp(f.bar_file, first_bar->bar_file) != 0) {
        block_fail(b, fmt("kernel %s: threads of one block wait at different __syncthreads() calls "
                          "(%s:%d for thread %d, %s:%d for thread %d): divergent barrier",
                          b.kernel, first_bar->bar_file, first_bar->bar_line, first_bar->linear, f.bar_file,
                          f.bar_line, f.linear));
        return;
      }
      count += f.bar_pred != 0;
      all &= f.bar_pred != 0;
      any |= f.bar_pred != 0;
    }
    for (int i = 0; i < b.nthreads; ++i) {
      Fiber& f = b.fibers[i];
      f.bar_res = f.bar_kind == 1 ? count : f.bar_kind == 2 ? all : f.bar_kind == 3 ? any : 0;
      f.st = St::Ready;
    }
    return;
  }
  if (first_bar && n_warp == 0) {
    block_fail(b, fmt("kernel %s: __syncthreads() at %s:%d reached by %d of %d threads; %d threads exited "
                      "without reaching it: divergent barrier",
                      b.kernel, first_bar->bar_file, first_bar->bar_line, n_bar, b.nthreads, b.n_done));
    return;
  }
  if (first_warp) {
    Fiber& w = *first_warp;
    std::string missing;
    for (int l = 0; l < 32; ++l) {
      if (!(w.wmask >> l & 1u)) continue;
      Fiber& o = b.fibers[w.warp * 32 + l];
      if (o.st == St::Warp && o.wop == w.wop && o.wmask == w.wmask) continue;
      if (o.st == St::Warp)
        missing += fmt(" lane %d (in %s(mask=0x%08x): mismatched collective)", l, warp_op_name(o.wop), o.wmask);
      else
        missing += fmt(" lane %d (%s)", l, o.st == St::Done ? "exited" : "waits at __syncthreads");
      if (missing.size() > 600) {
        missing += " ...";
        break;
      }
    }
    block_fail(b, fmt("kernel %s: %s(mask=0x%08x) in warp %d can never complete; missing:%s",
                      b.kernel, warp_op_name(w.wop), w.wmask, w.warp, missing.c_str()));
    return;
  }
  block_fail(b, fmt("kernel %s: block stalled", b.kernel));
}

inline void run_block(Block& b, Arena& a) {
  b.fibers = a.fibers;
  b.n_done = 0;
  int i = 0;
  for (unsigned z = 0; z < b.bdim.z; ++z)
    for (unsigned y = 0; y < b.bdim.y; ++y)
      for (unsigned x = 0; x < b.bdim.x; ++x, ++i) {
        Fiber& f = a.fibers[i];
        f.tid = make_uint3(x, y, z);
        f.linear = i;
        f.lane = i & 31;
        f.warp = i >> 5;
        f.st = St::Ready;
        f.block = &b;
        f.sp = init_stack(f.stack_lo, f.stack_size);
      }
  g_block = &b;
  while (!b.failed) {
    bool ran = false;
    for (int t = 0; t < b.nthreads && !b.failed; ++t) {
      Fiber& f = b.fibers[t];
      if (f.st != St::Ready) continue;
      g_cur = &f;
      switch_to(&b.sched_sp, f.sp, f.stack_lo, f.stack_size);
      g_cur = nullptr;
      ran = true;
    }
    if (b.failed || b.n_done == b.nthreads) break;
    if (!ran) resolve_stall(b);
  }
  g_block = nullptr;
}

// ---- barriers and warp collectives (called inside fibers) ---------------------------------------------
inline int syncthreads_impl(int pred, int kind, const char* file, int line) {
  Fiber* f = g_cur;
  f->st = St::Barrier;
  f->bar_pred = pred;
  f->bar_kind = kind;
  f->bar_file = file;
  f->bar_line = line;
  yield_to_scheduler();
  return f->bar_res;
}

template <class T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp collectives move up to 8 bytes");
  uint64_t u = 0;
  memcpy(&u, &v, sizeof(T));
  return u;
}
template <class T>
inline T from_bits(uint64_t u) {
  T v;
  memcpy(&v, &u, sizeof(T));
  return v;
}

// Every lane named in the mask has arrived: compute each lane's result.
inline void complete_warp_op(Block& b, Fiber& self) {
  const unsigned mask = self.wmask;
  Fiber* lanes = b.fibers + self.warp * 32;
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    Fiber& f = lanes[l];
    const int w = f.wwidth;
    const int seg = l & ~(w - 1);
    int src = l;
    switch (f.wop) {
      case W_SHFL: src = seg | (f.warg & (w - 1)); break;
      case W_SHFL_UP: src = l - f.warg < seg ? l : l - f.warg; break;
      case W_SHFL_DOWN: src = l + f.warg >= seg + w ? l : l + f.warg; break;
      case W_SHFL_XOR: src = ((l ^ f.warg) & ~(w - 1)) != seg ? l : (l ^ f.warg); break;
      default: break;
    }
    switch (f.wop) {
      case W_SHFL:
      case W_SHFL_UP:
      case W_SHFL_DOWN:
      case W_SHFL_XOR:
        if (!(mask >> src & 1u)) {
          block_fail(b, fmt("kernel %s: %s in warp %d: lane %d reads lane %d, which is not in mask 0x%08x",
                            b.kernel, warp_op_name(f.wop), f.warp, l, src, mask));
          return;
        }
        f.wres = lanes[src].wval;
        break;
      case W_BALLOT:
      case W_ANY:
      case W_ALL: {
        unsigned bal = 0;
        for (int j = 0; j < 32; ++j)
          if ((mask >> j & 1u) && lanes[j].wval) bal |= 1u << j;
        f.wres = f.wop == W_BALLOT ? bal : f.wop == W_ANY ? (bal != 0) : (bal == mask);
        break;
      }
      case W_MATCH_ANY: {
        unsigned m = 0;
        for (int j = 0; j < 32; ++j)
          if ((mask >> j & 1u) && lanes[j].wval == f.wval) m |= 1u << j;
        f.wres = m;
        break;
      }
      case W_SYNC: f.wres = 0; break;
      default: {  // reductions over 32-bit values
        uint32_t acc = static_cast<uint32_t>(f.wval);
        for (int j = 0; j < 32; ++j) {
          if (!(mask >> j & 1u)) continue;
          uint32_t v = static_cast<uint32_t>(lanes[j].wval);
          int32_t sa = static_cast<int32_t>(acc), sv = static_cast<int32_t>(v);
          switch (f.wop) {
            case W_REDUCE_ADD: acc = j == l ? acc : acc + v; break;
            case W_REDUCE_MIN: acc = static_cast<uint32_t>(std::min(sa, sv)); break;
            case W_REDUCE_MAX: acc = static_cast<uint32_t>(std::max(sa, sv)); break;
            case W_REDUCE_UMIN: acc = std::min(acc, v); break;
            case W_REDUCE_UMAX: acc = std::max(acc, v); break;
            case W_REDUCE_AND: acc &= v; break;
            case W_REDUCE_OR: acc |= v; break;
            case W_REDUCE_XOR: acc = j == l ? acc : acc ^ v; break;
          }
        }
        f.wres = acc;
      }
    }
  }
  for (int l = 0; l < 32; ++l)
    if (mask >> l & 1u) lanes[l].st = St::Ready;
}

inline uint64_t warp_op(int op, unsigned mask, uint64_t val, int arg, int width) {
  Fiber* f = g_cur;
  Block& b = *f->block;
  if (!(mask >> f->lane & 1u))
    fail_in_fiber(fmt("kernel %s: %s called by lane %d with mask 0x%08x that does not name the calling lane",
                      b.kernel, warp_op_name(op), f->lane, mask));
  if (width <= 0 || width > 32 || (width & (width - 1)))
    fail_in_fiber(fmt("kernel %s: %s width %d is not a power of two in [1, 32]", b.kernel, warp_op_name(op),
                      width));
  f->wop = op;
  f->wmask = mask;
  f->wval = val;
  f->warg = arg;
  f->wwidth = width;
  f->st = St::Warp;
  Fiber* lanes = b.fibers + f->warp * 32;
  bool all_here = true;
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    if (f->warp * 32 + l >= b.nthreads)
      fail_in_fiber(fmt("kernel %s: %s mask 0x%08x names lane %d, which does not exist (block has %d threads)",
                        b.kernel, warp_op_name(op), mask, l, b.nthreads));
    Fiber& o = lanes[l];
    if (o.st == St::Warp) {
      // A lane inside a different collective may still finish it and come here (independent thread
      // scheduling); if it never can, the stall check reports the mismatch.
      if (o.wmask != mask || o.wop != op) all_here = false;
    } else if (o.st == St::Done) {
      fail_in_fiber(fmt("kernel %s: %s(mask=0x%08x) names lane %d, which has exited", b.kernel,
                        warp_op_name(op), mask, l));
    } else {
      all_here = false;
    }
  }
  if (all_here) {
    complete_warp_op(b, *f);
    if (b.failed) fail_in_fiber(b.err);
    return f->wres;
  }
  yield_to_scheduler();
  return f->wres;
}

inline char* dynamic_smem() { return g_block ? g_block->dyn_smem : nullptr; }

// ---- launching -------------------------------------------------------------------------------------------
// Mirrors freetoken/device/emu.py's LaunchArgs ctypes structure.
struct LaunchArgs {
  uint32_t grid[3];
  uint32_t block[3];
  uint64_t shmem;
  uint32_t nworkers;
  uint32_t nargs;
  void** args;
  const uint64_t* sizes;
  const char* kinds;
  char* err;
  uint64_t errlen;
};

// Largest dynamic shared memory of the consumer targets (sm_86/89/120 opt-in limit: 99 KiB per block).
constexpr uint64_t kMaxDynSmem = 101376;

template <class A>
inline bool kind_ok(char k) {
  using T = std::decay_t<A>;
  constexpr bool half = std::is_same<T, __half>::value;
  constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
  switch (k) {
    case 'p': return std::is_pointer<T>::value;
    case 'i': return std::is_integral<T>::value && std::is_signed<T>::value;
    case 'u': return std::is_integral<T>::value && std::is_unsigned<T>::value;
    case 'f': return std::is_floating_point<T>::value;
    case 'h': return half;
    case 'b': return bf16;
    case 's': return std::is_class<T>::value && !half && !bf16;
    default: return false;
  }
}

template <class A>
inline const char* kind_want() {
  using T = std::decay_t<A>;
  if (std::is_pointer<T>::value) return "a pointer (array)";
  if (std::is_same<T, __half>::value) return "__half (np.float16)";
  if (std::is_same<T, __nv_bfloat16>::value) return "__nv_bfloat16 (ml_dtypes.bfloat16)";
  if (std::is_floating_point<T>::value) return "a float (np.float32/np.float64)";
  if (std::is_integral<T>::value) return std::is_signed<T>::value ? "a signed integer" : "an unsigned integer";
  return "a struct (numpy structured scalar)";
}

template <class... A, size_t... I>
inline bool check_args(const char* name, const LaunchArgs* a, std::string& err, std::index_sequence<I...>) {
  const size_t sizes[] = {sizeof(std::decay_t<A>)..., 0};
  const bool ok[] = {kind_ok<A>(a->kinds[I])..., true};
  const char* want[] = {kind_want<A>()..., ""};
  for (size_t i = 0; i < sizeof...(A); ++i) {
    if (!ok[i] || sizes[i] != a->sizes[i]) {
      err = fmt("kernel %s: argument %zu must be %s of %zu bytes; got kind '%c' of %llu bytes", name, i,
                want[i], sizes[i], a->kinds[i], static_cast<unsigned long long>(a->sizes[i]));
      return false;
    }
  }
  return true;
}

template <class... A>
struct Call {
  void (*fn)(A...);
  std::tuple<std::decay_t<A>...> args;
  static void run(const void* p) {
    const Call* c = static_cast<const Call*>(p);
    std::apply(c->fn, c->args);  // every thread gets its own copy of the arguments, as on the GPU
  }
};

template <class... A, size_t... I>
inline void unpack(Call<A...>& c, const LaunchArgs* a, std::index_sequence<I...>) {
  (memcpy(&std::get<I>(c.args), a->args[I], sizeof(std::decay_t<A>)), ...);
}

inline int report(const LaunchArgs* a, const std::string& msg) {
  if (a->err && a->errlen) {
    snprintf(a->err, a->errlen, "%s", msg.c_str());
  }
  return 1;
}

template <class... A>
inline int launch(const char* name, void (*fn)(A...), const LaunchArgs* a, int max_threads) {
  std::string err;
  if (a->nargs != sizeof...(A))
    return report(a, fmt("kernel %s takes %zu arguments, got %u", name, sizeof...(A), a->nargs));
  if (!check_args<A...>(name, a, err, std::index_sequence_for<A...>{})) return report(a, err);
  const uint64_t nthreads = uint64_t(a->block[0]) * a->block[1] * a->block[2];
  const uint64_t nblocks = uint64_t(a->grid[0]) * a->grid[1] * a->grid[2];
  if (nthreads == 0 || nthreads > kMaxThreads || a->block[2] > 64)
    return report(a, fmt("kernel %s: block (%u,%u,%u) is not a valid CUDA block (1..1024 threads, z <= 64)",
                         name, a->block[0], a->block[1], a->block[2]));
  if (max_threads > 0 && nthreads > uint64_t(max_threads))
    return report(a, fmt("kernel %s: block of %llu threads exceeds its __launch_bounds__(%d)", name,
                         static_cast<unsigned long long>(nthreads), max_threads));
  if (a->grid[1] > 65535 || a->grid[2] > 65535 || a->grid[0] > 0x7fffffffu)
    return report(a, fmt("kernel %s: grid (%u,%u,%u) exceeds CUDA's limits", name, a->grid[0], a->grid[1],
                         a->grid[2]));
  if (a->shmem > kMaxDynSmem)
    return report(a, fmt("kernel %s: %llu bytes of dynamic shared memory exceed the 99 KiB that consumer GPUs "
                         "(sm_86/89/120) allow per block",
                         name, static_cast<unsigned long long>(a->shmem)));
  if (nblocks == 0) return 0;

  Call<A...> call{fn, {}};
  unpack(call, a, std::index_sequence_for<A...>{});

  const unsigned nworkers = static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>(a->nworkers, nblocks)));
  std::atomic<uint64_t> next{0};
  std::atomic<bool> abort{false};
  std::mutex err_mu;
  std::string first_err;
  const size_t smem_bytes = static_cast<size_t>(a->shmem);

  auto worker = [&]() {
    Arena* arena = get_arena();
    if (!arena) {
      std::lock_guard<std::mutex> lk(err_mu);
      if (first_err.empty()) first_err = fmt("kernel %s: cannot map fiber stacks", name);
      abort = true;
      return;
    }
    guard_stacks(*arena, static_cast<int>(nthreads));
    std::vector<char> smem(smem_bytes + 128);
    char* dyn = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem.data()) + 127) & ~uintptr_t(127));
    Block b;
    b.kernel = name;
    b.bdim = dim3(a->block[0], a->block[1], a->block[2]);
    b.gdim = dim3(a->grid[0], a->grid[1], a->grid[2]);
    b.nthreads = static_cast<int>(nthreads);
    b.entry = &Call<A...>::run;
    b.entry_ctx = &call;
    b.dyn_smem = dyn;
    b.dyn_size = smem_bytes;
    for (;;) {
      if (abort.load(std::memory_order_relaxed)) break;
      uint64_t id = next.fetch_add(1);
      if (id >= nblocks) break;
      b.bid = make_uint3(static_cast<unsigned>(id % a->grid[0]),
                         static_cast<unsigned>((id / a->grid[0]) % a->grid[1]),
                         static_cast<unsigned>(id / (uint64_t(a->grid[0]) * a->grid[1])));
      memset(dyn, 0xFF, smem_bytes);  // poison: reading shared memory nobody wrote gives NaN / -1
      run_block(b, *arena);
      if (b.failed) {
        std::lock_guard<std::mutex> lk(err_mu);
        if (first_err.empty()) first_err = b.err;
        abort = true;
        break;
      }
    }
    put_arena(arena);
  };

  std::vector<std::thread> pool;
  for (unsigned w = 1; w < nworkers; ++w) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (!first_err.empty()) return report(a, first_err);
  return 0;
}

}  // namespace ftemu

// ---- the CUDA device API, host versions ---------------------------------------------------------------
#define threadIdx (::ftemu::g_cur->tid)
#define blockIdx (::ftemu::g_block->bid)
#define blockDim (::ftemu::g_block->bdim)
#define gridDim (::ftemu::g_block->gdim)
#define warpSize 32

#define __syncthreads() ::ftemu::syncthreads_impl(0, 0, __FILE__, __LINE__)
#define __syncthreads_count(p) ::ftemu::syncthreads_impl((p), 1, __FILE__, __LINE__)
#define __syncthreads_and(p) ::ftemu::syncthreads_impl((p), 2, __FILE__, __LINE__)
#define __syncthreads_or(p) ::ftemu::syncthreads_impl((p), 3, __FILE__, __LINE__)

inline void __syncwarp(unsigned mask = 0xffffffffu) { ::ftemu::warp_op(::ftemu::W_SYNC, mask, 0, 0, 32); }

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return ::ftemu::from_bits<T>(::ftemu::warp_op(::ftemu::W_SHFL, mask, ::ftemu::to_bits(v), src, width));
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::ftemu::from_bits<T>(
      ::ftemu::warp_op(::ftemu::W_SHFL_UP, mask, ::ftemu::to_bits(v), static_cast<int>(delta), width));
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::ftemu::from_bits<T>(
      ::ftemu::warp_op(::ftemu::W_SHFL_DOWN, mask, ::ftemu::to_bits(v), static_cast<int>(delta), width));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return ::ftemu::from_bits<T>(::ftemu::warp_op(::ftemu::W_SHFL_XOR, mask, ::ftemu::to_bits(v), lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return static_cast<unsigned>(::ftemu::warp_op(::ftemu::W_BALLOT, mask, pred != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int pred) {
  return static_cast<int>(::ftemu::warp_op(::ftemu::W_ANY, mask, pred != 0, 0, 32));
}
inline int __all_sync(unsigned mask, int pred) {
  return static_cast<int>(::ftemu::warp_op(::ftemu::W_ALL, mask, pred != 0, 0, 32));
}
template <class T>
inline unsigned __match_any_sync(unsigned mask, T v) {
  return static_cast<unsigned>(::ftemu::warp_op(::ftemu::W_MATCH_ANY, mask, ::ftemu::to_bits(v), 0, 32));
}
#define FTEMU_REDUCE(NAME, OP, T)                                                                            \
  inline T NAME(unsigned mask, T v) {                                                                        \
    return static_cast<T>(::ftemu::warp_op(OP, mask, static_cast<uint32_t>(v), 0, 32));                      \
  }
FTEMU_REDUCE(__reduce_add_sync, ::ftemu::W_REDUCE_ADD, unsigned)
FTEMU_REDUCE(__reduce_add_sync, ::ftemu::W_REDUCE_ADD, int)
FTEMU_REDUCE(__reduce_min_sync, ::ftemu::W_REDUCE_UMIN, unsigned)
FTEMU_REDUCE(__reduce_min_sync, ::ftemu::W_REDUCE_MIN, int)
FTEMU_REDUCE(__reduce_max_sync, ::ftemu::W_REDUCE_UMAX, unsigned)
FTEMU_REDUCE(__reduce_max_sync, ::ftemu::W_REDUCE_MAX, int)
FTEMU_REDUCE(__reduce_and_sync, ::ftemu::W_REDUCE_AND, unsigned)
FTEMU_REDUCE(__reduce_or_sync, ::ftemu::W_REDUCE_OR, unsigned)
FTEMU_REDUCE(__reduce_xor_sync, ::ftemu::W_REDUCE_XOR, unsigned)
#undef FTEMU_REDUCE

// The lanes of the caller's warp that have not exited (the emulator has no notion of convergence).
inline unsigned __activemask() {
  ::ftemu::Fiber* f = ::ftemu::g_cur;
  ::ftemu::Block* b = f->block;
  unsigned m = 0;
  for (int l = 0; l < 32; ++l) {
    int t = f->warp * 32 + l;
    if (t < b->nthreads && b->fibers[t].st != ::ftemu::St::Done) m |= 1u << l;
  }
  return m;
}

// ---- atomics: real host atomics, since blocks run on several OS threads -------------------------------
template <class T>
using ftemu_int_t = std::enable_if_t<std::is_integral<T>::value, T>;

template <class T> inline ftemu_int_t<T> atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
template <class T> inline ftemu_int_t<T> atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
template <class T> inline ftemu_int_t<T> atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); }
template <class T> inline ftemu_int_t<T> atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
template <class T> inline ftemu_int_t<T> atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); }
template <class T> inline ftemu_int_t<T> atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
template <class T>
inline ftemu_int_t<T> atomicCAS(T* p, T expected, T desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;  // the old value, whether or not the swap happened
}
template <class T>
inline ftemu_int_t<T> atomicMin(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
  return old;
}
template <class T>
inline ftemu_int_t<T> atomicMax(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (v > old && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
  return old;
}
inline unsigned atomicInc(unsigned* p, unsigned limit) {
  unsigned old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(p, &old, old >= limit ? 0u : old + 1u, true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {}
  return old;
}
inline unsigned atomicDec(unsigned* p, unsigned limit) {
  unsigned old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(p, &old, (old == 0u || old > limit) ? limit : old - 1u, true,
                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
  return old;
}
template <class F, class U>
inline F ftemu_atomic_float(F* p, F v, int op) {
  U* u = reinterpret_cast<U*>(p);
  U old = __atomic_load_n(u, __ATOMIC_RELAXED);
  for (;;) {
    F cur;
    memcpy(&cur, &old, sizeof(F));
    F nxt = op == 0 ? cur + v : v;
    U nu;
    memcpy(&nu, &nxt, sizeof(F));
    if (__atomic_compare_exchange_n(u, &old, nu, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return cur;
  }
}
inline float atomicAdd(float* p, float v) { return ftemu_atomic_float<float, uint32_t>(p, v, 0); }
inline double atomicAdd(double* p, double v) { return ftemu_atomic_float<double, uint64_t>(p, v, 0); }
inline float atomicExch(float* p, float v) { return ftemu_atomic_float<float, uint32_t>(p, v, 1); }
#define atomicAdd_block atomicAdd
#define atomicAdd_system atomicAdd
#define atomicCAS_block atomicCAS
#define atomicExch_block atomicExch
#define atomicMax_block atomicMax
#define atomicMin_block atomicMin

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// ---- loads/stores with cache hints: plain accesses on the host -----------------------------------------
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ---- integer and float intrinsics --------------------------------------------------------------------
template <class A, class B, class = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value>>
inline std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <class A, class B, class = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value>>
inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __tanhf(float x) { return tanhf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
inline unsigned __float_as_uint(float x) { unsigned i; memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; memcpy(&x, &i, 4); return x; }
inline float __uint_as_float(unsigned i) { float x; memcpy(&x, &i, 4); return x; }
inline long long __double_as_longlong(double x) { long long i; memcpy(&i, &x, 8); return i; }
inline double __longlong_as_double(long long i) { double x; memcpy(&x, &i, 8); return x; }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(floorf(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(ceilf(x)); }
inline unsigned __float2uint_rn(float x) { return static_cast<unsigned>(nearbyintf(x)); }
inline unsigned __float2uint_rz(float x) { return static_cast<unsigned>(x); }
inline long long __float2ll_rn(float x) { return static_cast<long long>(nearbyintf(x)); }
inline float __int2float_rn(int i) { return static_cast<float>(i); }
inline float __uint2float_rn(unsigned i) { return static_cast<float>(i); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
  return __builtin_bswap32(x);
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  return static_cast<unsigned>((((uint64_t(hi) << 32) | lo) << (s & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  return static_cast<unsigned>((((uint64_t(hi) << 32) | lo) >> (s & 31)));
}
inline int __mul24(int a, int b) { return (a << 8 >> 8) * (b << 8 >> 8); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xFFFFFFu) * (b & 0xFFFFFFu); }
inline int __mulhi(int a, int b) { return static_cast<int>((int64_t(a) * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((uint64_t(a) * b) >> 32); }
inline long long __mul64hi(long long a, long long b) { return static_cast<long long>((__int128(a) * b) >> 64); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline long long clock64() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
inline void __nanosleep(unsigned) {}
[[noreturn]] inline void __trap() { ::ftemu::fail_in_fiber("kernel executed __trap()"); }

#undef assert
#define assert(e) \
  ((e) ? (void)0 : ::ftemu::fail_in_fiber(::ftemu::fmt("device assert failed: %s at %s:%d", #e, __FILE__, __LINE__)))
