"""Host memory in transparent huge pages, for the weights the cpu device streams on every decode step.

A decode step reads every dense matrix once, front to back. On 4 KiB pages that stream stalls at each page: the
hardware prefetchers stop at page boundaries and every page costs a TLB walk. Measured on 2 cores of a Sapphire
Rapids Xeon, an f16 1536 x 1024 GEMV cycled through 144 MB of matrices: 9.4 GB/s on one thread and 16.0 GB/s on two
from 4 KiB pages, 12.4 and 24.3 GB/s from 2 MiB pages (a plain read: 13.5 and 26.3 GB/s).

NumPy already asks for huge pages (``madvise(MADV_HUGEPAGE)``) for its own allocations of 4 MiB or more, which
covers the expert banks and the KV pool. The dense matrices are smaller (a layer's q/k/v, its output projection, a
router) or views of a memory-mapped file (page-cache pages, always 4 KiB), so the cpu device copies them into a
:class:`HugePageArena`: anonymous mappings aligned to 2 MiB and advised ``MADV_HUGEPAGE``, sub-allocated 64-byte
aligned, so that many small matrices share huge pages.

Where the kernel's THP setting is ``never`` (or there is no ``madvise``) the arena still works, on small pages.
:func:`thp_mode` reports the setting (``freetoken info``).
"""

from __future__ import annotations

import mmap
import threading
import weakref
from pathlib import Path

import numpy as np

#: The huge page size the arena aligns its mappings to (x86-64 and most arm64 kernels).
HUGE_PAGE = 2 << 20
#: Bytes of one shared mapping; larger arrays get a mapping of their own.
CHUNK_BYTES = 32 << 20
#: Alignment of every array handed out (a cache line; what the vector kernels' loads like).
ALIGN = 64
#: NumPy advises huge pages itself for allocations of at least this many bytes (numpy/_core/src/multiarray/alloc.c).
NUMPY_HUGEPAGE_BYTES = 4 << 20

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: The arrays over the arenas' mappings by id (every array handed out is a view of one), so that they are not copied
#: again; an entry goes when its array does (no stale id can match a later array).
_ARENA_ROOTS: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page setting, ``always``, ``madvise`` or ``never`` (None where there is none)."""
    try:
        text = _THP.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class HugePageArena:
    """Sub-allocates arrays from 2 MiB-aligned anonymous mappings advised ``MADV_HUGEPAGE``.

    Arrays are never freed one by one: the mappings live as long as any array handed out from them (each array
    keeps its mapping alive). Unused bytes of a mapping cost no memory until touched."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = _round_up(int(chunk_bytes), HUGE_PAGE)
        self._chunk: np.ndarray | None = None  # the current shared mapping's bytes (2 MiB aligned)
        self._used = 0
        self._lock = threading.Lock()

    @staticmethod
    def _map(nbytes: int) -> np.ndarray:
        """A fresh anonymous mapping of ``nbytes`` (a multiple of :data:`HUGE_PAGE`) starting on a huge page."""
        # private: a shared anonymous mapping is shmem, which follows shmem_enabled (usually never), not THP
        mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = np.frombuffer(mm, np.uint8)  # the array holds the mapping open
        _ARENA_ROOTS[id(raw)] = raw
        start = -raw.ctypes.data % HUGE_PAGE
        advise = getattr(mmap, "MADV_HUGEPAGE", None)
        if advise is not None:
            try:
                mm.madvise(advise, start, nbytes)
            except OSError:  # THP compiled out or refused: small pages, same arrays
                pass
        return raw[start:start + nbytes]

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised C-contiguous array, 64-byte aligned, in huge-page memory."""
        dtype = np.dtype(dtype)
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        need = _round_up(max(nbytes, 1), ALIGN)
        with self._lock:
            if need > self.chunk_bytes // 4:  # a large array: its own mapping, no tail of a chunk wasted
                buf = self._map(_round_up(need, HUGE_PAGE))[:nbytes]
            else:
                if self._chunk is None or self._used + need > self._chunk.size:
                    self._chunk, self._used = self._map(self.chunk_bytes), 0
                buf = self._chunk[self._used:self._used + nbytes]
                self._used += need
        return buf.view(dtype).reshape(shape)

    def copy(self, a) -> np.ndarray:
        """A C-contiguous copy of ``a`` in huge-page memory (same dtype and shape)."""
        a = np.asarray(a)
        out = self.empty(a.shape, a.dtype)
        np.copyto(out, a, casting="no")
        return out


def wants_huge_pages(a: np.ndarray) -> bool:
    """Whether a weight array is worth copying into the arena: not when it lies in an arena's mapping already, nor
    when it is (a view of) an array NumPy allocated itself at a size it advises huge pages for. A view of a memory
    map (page cache) or of a small allocation is."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root.base is None:
        return not (root.flags.owndata and root.nbytes >= NUMPY_HUGEPAGE_BYTES)
    return _ARENA_ROOTS.get(id(root)) is not root
