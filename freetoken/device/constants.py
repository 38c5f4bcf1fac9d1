"""Constants shared by the Python launchers and the CUDA sources, defined once, here.

Every compile (gpu, emu and the NVRTC check of all architectures) receives :data:`CUDA_DEFINES` as ``-D``
options (:func:`define_options`, added by :func:`freetoken.device.nvrtc.compile_cubin` and
:func:`freetoken.device.emu_build.build`); the ``.cu`` / ``.cuh`` sources use the ``FT_*`` names and never define
them (``cuda/common.cuh`` stops a compile without them with an ``#error``), and they ``static_assert`` the struct
layouts the launchers pack (``ft::ExpertBanks``, ``ft::Plan``, the cache's ``BankTable``) against the sizes and
offsets given here. The Numba kernels (``cpu_kernels/``) and the launchers (``freetoken/ops/``) import the same
values. They live in the device layer, the lowest that compiles kernels, so everything above can read them.
"""

from __future__ import annotations

import numpy as np

# ---- routed experts (cuda/moe_*.cu) -----------------------------------------------------------------------------
#: Pairs (token, k) per prefill tile (FT_TILE_M).
TILE_M = 64
#: Output rows per block of the decode expert kernels (FT_ROWS).
DECODE_ROWS = 8
#: Output rows per block of the prefill expert kernels (FT_TILE_N).
PREFILL_ROWS = 64
#: Up to this many tokens the decode kernels run (moe_experts mode="auto"; attention's decode kernel too).
DECODE_MAX_TOKENS = 16

#: Activation codes (cuda/moe_common.cuh, cpu_kernels/moe_experts.py, the reference).
ACT_SWIGLU = 0  # silu(gate) * up (Qwen, Mixtral, DeepSeek, OLMoE)
ACT_GPT_OSS = 1  # gate = min(gate, 7); up = clamp(up, -7, 7); (up + 1) * gate * sigmoid(1.702 * gate)
ACTIVATIONS = {"swiglu": ACT_SWIGLU, "gpt_oss": ACT_GPT_OSS}
GPT_OSS_LIMIT = 7.0
GPT_OSS_ALPHA = 1.702


def activation_code(act: str) -> int:
    """The code of activation ``act`` ("swiglu" or "gpt_oss")."""
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r}; choose one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]

#: Kernel-family format codes (the template argument of the expert kernels, cuda/moe_common.cuh; the Numba kernels'
#: fmt argument): the one definition. Which formats each family reads: freetoken.formats.table.
FORMAT_CODES = {"bf16": 0, "fp8_block": 1, "nvfp4": 2, "mxfp4": 3, "q4_0": 4, "q8_0": 5, "q4_k": 6, "q5_k": 7,
                "q6_k": 8, "iq4_xs": 9}

#: ft::ExpertBanks (cuda/moe_common.cuh): for gate, up, down the pointers w, s, g, b, then each bank's bytes from
#: one slot to the next (a bank's slot rows may be longer than its record's: slots sized for the largest record).
EXPERT_BANKS = np.dtype([(f"{m}_{f}{part}", np.uint64) for m in ("gate", "up", "down") for part in ("", "_stride")
                         for f in ("w", "s", "g", "b")], align=True)
#: ft::Plan (cuda/moe_common.cuh).
PLAN = np.dtype([(n, np.uint64) for n in ("n_unique", "unique_slot", "unique_off", "pair_list", "n_tiles",
                                          "tile_unique", "tile_start")], align=True)

# ---- expert cache (cuda/cache.cu) -------------------------------------------------------------------------------
#: Routed pairs per admit call (FT_CACHE_MAX_PAIRS).
CACHE_MAX_PAIRS = 1024
#: Banks per record (FT_CACHE_MAX_BANKS).
CACHE_MAX_BANKS = 16
#: cache.cu's BankTable.
BANK_TABLE = np.dtype([("src", np.uint64, CACHE_MAX_BANKS), ("dst", np.uint64, CACHE_MAX_BANKS),
                       ("bytes", np.uint64, CACHE_MAX_BANKS), ("dst_stride", np.uint64, CACHE_MAX_BANKS),
                       ("first", np.int64), ("n", np.int32)], align=True)
#: The id of a routed pair that goes nowhere (FT_NO_ROUTE): admission leaves it unmapped and the expert kernels skip
#: it (it adds nothing to its token's output). A layer whose experts are in several formats runs once per format
#: with the other formats' pairs marked so.
NO_ROUTE = -1
#: Error codes of cache_admit (and its Numba twin).
CACHE_ERR_ID_RANGE = 1
CACHE_ERR_NO_VICTIM = 2
#: The slot id cache_admit_scored writes for a pair whose miss was bypassed (FT_CACHE_BYPASSED): not loaded, no slot;
#: the caller serves it elsewhere (its flat id is in the admission's bypass list). scored.BYPASSED is the same value.
CACHE_BYPASSED = -2
#: The scored (next_use) admission's global estimates, indices into its float64 [3] array (FT_SCORED_G_*): decayed
#: continuations, decayed re-accesses, average loads per call (freetoken/policy/scored.py uses the same).
SCORED_G_CONT, SCORED_G_REUSE, SCORED_G_LOADS = 0, 1, 2
#: next_use's horizon bounds in steps (FT_SCORED_TAU_MIN / _MAX) and the keep key offset of an id used at its layer's
#: latest call (FT_SCORED_PROTECT = 2 ** 40): see freetoken/policy/next_use.py.
SCORED_TAU_MIN, SCORED_TAU_MAX = 1.0, 1e6
SCORED_PROTECT = float(2 ** 40)
#: cache.cu's ScoredConsts (cache_admit_scored's per-cache constants, passed by value): the rate scales q = 1 - dp[1]
#: and q2 = 1 - dp2[1], rho, kappa, id decay, global decay, loads weight, long weight; the prefill prior's weight,
#: keep and long keep (cache_scored_prefill); the decay tables' last indices; layers, bypass, cycle.
SCORED_CONSTS = np.dtype([("q", np.float64), ("q2", np.float64), ("rho", np.float64), ("kappa", np.float64),
                          ("id_decay", np.float64), ("global_decay", np.float64), ("load_weight", np.float64),
                          ("long_weight", np.float64), ("prior_weight", np.float64), ("prior_keep", np.float64),
                          ("long_prior_keep", np.float64), ("dp_last", np.int64), ("dp2_last", np.int64),
                          ("layers", np.int32), ("bypass", np.int32), ("cycle", np.int32)], align=True)

# ---- dense GEMV (cuda/dense.cu) ---------------------------------------------------------------------------------
#: The most tokens one dense_gemv call takes (FT_DENSE_MAX_T).
DENSE_MAX_TOKENS = 8
#: Warps (output rows) per block of dense_gemv (FT_DENSE_WARPS).
DENSE_WARPS = 4

# ---- paged KV cache (cuda/paged_attention.cu, cuda/kv.cuh) -------------------------------------------------------
#: Keys per warp tile (FT_ATT_TILE) and warps per block (FT_ATT_WARPS) of the paged decode kernels.
ATT_TILE = 32
ATT_WARPS = 4
#: Largest finite e4m3fn magnitude: an fp8 row's scale is its amax / KV_FP8_MAX (FT_KV_FP8_MAX).
KV_FP8_MAX = 448.0
#: KV kind -> the code the paged attention kernels take as their ``kind`` argument (FT_KV_F32, ..., ft::KvKind).
KV_KIND_CODES = {"f32": 0, "f16": 1, "bf16": 2, "fp8": 3}

# ---- multi-head latent attention (cuda/latent_attention.cu) -----------------------------------------------------
#: (query, head) rows per block (FT_LATENT_ROWS) and keys per shared-memory tile (FT_LATENT_KEYS) of the latent
#: attention kernel.
LATENT_ROWS = 32
LATENT_KEYS = 32
#: The widest cached latent row, R + P values (FT_LATENT_MAX_DIM): the kernel's largest build.
LATENT_MAX_DIM = 1024

# ---- small row ops (cuda/rms_norm.cu, cuda/routing.cu) ----------------------------------------------------------
#: The largest block of rms_norm_f32 (FT_NORM_THREADS).
NORM_THREADS = 256
#: Warps (rows) per block of route_softmax_topk_f32 (FT_ROUTE_WARPS).
ROUTE_WARPS = 4

# ---- Gated DeltaNet (cuda/linear_attention.cu, freetoken.ops.linear_attention) ---------------------------------
#: The largest key/value head dim (FT_LINEAR_MAX_HEAD_DIM: gated_delta_rule_f32 holds a block's state columns,
#: that many rows of FT_LINEAR_COLUMNS floats, in static shared memory) and the most taps of the short convolution
#: (FT_LINEAR_CONV_MAX_TAPS) the ops take (Qwen3-Next / Qwen3.5: 128 and 4).
LINEAR_MAX_HEAD_DIM = 256
LINEAR_CONV_MAX_TAPS = 8
#: Channels (one thread each) per block of short_conv_f32 (FT_LINEAR_CONV_THREADS).
LINEAR_CONV_THREADS = 128
#: Value columns (one thread each) per block of gated_delta_rule_f32 (FT_LINEAR_COLUMNS).
LINEAR_COLUMNS = 32
#: Tokens per chunk of the gated delta rule's chunked (WY) form on gpu/emu (FT_LINEAR_CHUNK; the kernels'
#: thread roles are written for 64: cuda/linear_attention.cu static_asserts it).
LINEAR_CHUNK = 64
#: From this many tokens on, ops.gated_delta_rule (mode="auto") runs the chunked form on gpu/emu; below it (decode,
#: short prompts) the recurrent kernel, which takes one launch and no scratch. Python only.
LINEAR_CHUNKED_MIN_TOKENS = LINEAR_CHUNK
#: Value columns (state columns) per block of the chunked form's scan over chunks (FT_LINEAR_CHUNK_COLUMNS): 16 keeps
#: the block's state columns at 16 KiB of shared memory at the largest head dim.
LINEAR_CHUNK_COLUMNS = 16
#: Threads per block of both chunked-form kernels (FT_LINEAR_CHUNK_THREADS: 4 a token of the chunk).
LINEAR_CHUNK_THREADS = 256
#: Floats of the chunked form's scratch per (value head, chunk) (FT_LINEAR_CHUNK_RECORD): Tb and P [C, C] and four
#: coefficients per token.
LINEAR_CHUNK_RECORD = 2 * LINEAR_CHUNK * LINEAR_CHUNK + 4 * LINEAR_CHUNK
#: ``l2norm``'s epsilon on q and k inside the gated delta rule: ``x * rsqrt(sum(x^2) + eps)`` (fla's and
#: transformers' value; FT_LINEAR_L2NORM_EPS).
LINEAR_L2NORM_EPS = 1e-6


def _struct_defines(prefix: str, dtype: np.dtype) -> dict[str, str]:
    out = {f"{prefix}_SIZE": str(dtype.itemsize)}
    for name in dtype.names:
        out[f"{prefix}_{name.upper()}_OFFSET"] = str(dtype.fields[name][1])
    return out


def _float(v: float) -> str:
    return f"{float(v)!r}f"


#: name -> C literal of every definition the CUDA sources receive.
CUDA_DEFINES: dict[str, str] = {
    "FT_CONSTANTS": "1",
    "FT_TILE_M": str(TILE_M),
    "FT_ROWS": str(DECODE_ROWS),
    "FT_TILE_N": str(PREFILL_ROWS),
    "FT_ACT_SWIGLU": str(ACT_SWIGLU),
    "FT_ACT_GPT_OSS": str(ACT_GPT_OSS),
    "FT_GPT_OSS_LIMIT": _float(GPT_OSS_LIMIT),
    "FT_GPT_OSS_ALPHA": _float(GPT_OSS_ALPHA),
    **{f"FT_FMT_{name.upper()}": str(code) for name, code in FORMAT_CODES.items()},
    "FT_CACHE_MAX_PAIRS": str(CACHE_MAX_PAIRS),
    "FT_CACHE_MAX_BANKS": str(CACHE_MAX_BANKS),
    "FT_NO_ROUTE": str(NO_ROUTE),
    "FT_CACHE_ERR_ID_RANGE": str(CACHE_ERR_ID_RANGE),
    "FT_CACHE_ERR_NO_VICTIM": str(CACHE_ERR_NO_VICTIM),
    "FT_CACHE_BYPASSED": str(CACHE_BYPASSED),
    "FT_SCORED_G_CONT": str(SCORED_G_CONT),
    "FT_SCORED_G_REUSE": str(SCORED_G_REUSE),
    "FT_SCORED_G_LOADS": str(SCORED_G_LOADS),
    "FT_SCORED_TAU_MIN": repr(float(SCORED_TAU_MIN)),
    "FT_SCORED_TAU_MAX": repr(float(SCORED_TAU_MAX)),
    "FT_SCORED_PROTECT": repr(float(SCORED_PROTECT)),
    "FT_DENSE_MAX_T": str(DENSE_MAX_TOKENS),
    "FT_DENSE_WARPS": str(DENSE_WARPS),
    "FT_ATT_TILE": str(ATT_TILE),
    "FT_ATT_WARPS": str(ATT_WARPS),
    "FT_KV_FP8_MAX": _float(KV_FP8_MAX),
    **{f"FT_KV_{kind.upper()}": str(code) for kind, code in KV_KIND_CODES.items()},
    "FT_LATENT_ROWS": str(LATENT_ROWS),
    "FT_LATENT_KEYS": str(LATENT_KEYS),
    "FT_LATENT_MAX_DIM": str(LATENT_MAX_DIM),
    "FT_NORM_THREADS": str(NORM_THREADS),
    "FT_ROUTE_WARPS": str(ROUTE_WARPS),
    "FT_LINEAR_MAX_HEAD_DIM": str(LINEAR_MAX_HEAD_DIM),
    "FT_LINEAR_CONV_MAX_TAPS": str(LINEAR_CONV_MAX_TAPS),
    "FT_LINEAR_CONV_THREADS": str(LINEAR_CONV_THREADS),
    "FT_LINEAR_COLUMNS": str(LINEAR_COLUMNS),
    "FT_LINEAR_L2NORM_EPS": _float(LINEAR_L2NORM_EPS),
    "FT_LINEAR_CHUNK": str(LINEAR_CHUNK),
    "FT_LINEAR_CHUNK_COLUMNS": str(LINEAR_CHUNK_COLUMNS),
    "FT_LINEAR_CHUNK_THREADS": str(LINEAR_CHUNK_THREADS),
    "FT_LINEAR_CHUNK_RECORD": str(LINEAR_CHUNK_RECORD),
    **_struct_defines("FT_EXPERT_BANKS", EXPERT_BANKS),
    **_struct_defines("FT_PLAN", PLAN),
    **_struct_defines("FT_BANK_TABLE", BANK_TABLE),
    **_struct_defines("FT_SCORED_CONSTS", SCORED_CONSTS),
}


def define_options(defines: dict[str, str] | None = None) -> list[str]:
    """``defines`` (default :data:`CUDA_DEFINES`) as ``-DNAME=VALUE`` options, sorted by name (stable cache keys)."""
    defines = CUDA_DEFINES if defines is None else defines
    return [f"-D{name}={defines[name]}" for name in sorted(defines)]
