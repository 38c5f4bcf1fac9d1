"""The cpu device's weights in transparent huge pages (freetoken.device.hugepages)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from freetoken.device import get_device
from freetoken.device.hugepages import ALIGN, NUMPY_HUGEPAGE_BYTES, HugePageArena, thp_mode
from freetoken.models.linear import Linear


def _vma_field(addr: int, field: str) -> str | None:
    """``field`` of the mapping that holds ``addr`` in /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


def _vm_flags(a: np.ndarray) -> set[str]:
    return set((_vma_field(a.ctypes.data, "VmFlags") or "").split())


def _thp_disabled_for_this_process() -> bool:
    """prctl(PR_SET_THP_DISABLE) (some containers and service managers set it): no mapping is eligible then, whatever
    /sys says, so only the advice itself can be checked."""
    status = Path("/proc/self/status").read_text()
    return any(line.split()[1:] == ["0"] for line in status.splitlines() if line.startswith("THP_enabled:"))


def _advised(a: np.ndarray) -> bool:
    """Whether ``a``'s mapping is advised MADV_HUGEPAGE ("hg") and the kernel counts it eligible for huge pages."""
    return "hg" in _vm_flags(a) and (_thp_disabled_for_this_process()
                                     or _vma_field(a.ctypes.data, "THPeligible") == "1")


def test_arena_hands_out_aligned_disjoint_writable_arrays():
    arena = HugePageArena(chunk_bytes=4 << 20)
    arrays = [arena.empty(shape, dtype) for shape, dtype in
              [((3, 5), np.float32), (7, np.uint8), ((1000, 3), np.float16), ((2 << 20,), np.uint8), (0, np.int32)]]
    for a in arrays:
        assert a.ctypes.data % ALIGN == 0 and a.flags.c_contiguous and a.flags.writeable
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays if a.nbytes)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans[:-1], spans[1:], strict=True))
    for i, a in enumerate(arrays):
        a[...] = i
    assert all((a == i).all() for i, a in enumerate(arrays))  # no array wrote over another


def test_arena_copy_is_exact_and_private():
    src = np.random.default_rng(0).standard_normal((33, 17)).astype(np.float16)
    arena = HugePageArena()
    out = arena.copy(src[:, ::-1])  # a strided source: the copy is C-contiguous
    assert out.dtype == src.dtype and out.flags.c_contiguous
    np.testing.assert_array_equal(out, src[:, ::-1])
    assert "sh" not in _vm_flags(out)  # a private mapping (a shared anonymous one is shmem: no THP)


def test_arena_memory_is_advised_for_huge_pages_where_the_kernel_offers_them():
    a = HugePageArena().empty(1 << 20, np.uint8)
    a[:] = 1
    if thp_mode() in ("always", "madvise"):
        assert _advised(a)
    else:  # THP off or absent: the arena still works, on small pages
        assert (a == 1).all()


def test_cpu_linear_places_small_and_file_backed_matrices_in_huge_pages():
    dev = get_device("cpu")
    w = np.random.default_rng(1).standard_normal((48, 64)).astype(np.float32)
    lin = Linear(w.astype(np.float16).astype(np.float32), dev)
    assert lin.storage == "f16"
    assert not lin.holds(w)
    x = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(lin(x), x @ w.astype(np.float16).astype(np.float32).T, rtol=1e-5, atol=1e-5)
    if thp_mode() in ("always", "madvise"):
        assert _advised(lin._w)


def test_cpu_tied_float32_head_stays_the_embedding():
    """A float32 matrix NumPy allocated at a size it already gives huge pages is used as it is: a tied lm_head on the
    cpu device reads the embedding table itself, and :meth:`Linear.holds` says so (weight_bytes counts it once)."""
    dev = get_device("cpu")
    rows = NUMPY_HUGEPAGE_BYTES // (4 * 64) + 1
    embed = np.random.default_rng(3).standard_normal((rows, 64)).astype(np.float32)
    embed[0, 0] = np.float32(1 / 3)  # not exact in bf16 or f16: stored float32
    head = Linear(embed, dev)
    assert head.storage == "f32" and head.holds(embed)
    small = Linear(embed[:8].copy(), dev)
    assert small.storage == "f32" and not small.holds(embed)


def test_what_is_copied_into_huge_pages():
    """Copied: a small array, a view of a memory-mapped file. Not copied: an arena array (or a view of one), a view
    of a large array NumPy allocated (and advised) itself."""
    from freetoken.device.hugepages import wants_huge_pages

    arena = HugePageArena()
    big = np.zeros(NUMPY_HUGEPAGE_BYTES, np.uint8)
    assert wants_huge_pages(np.zeros(16, np.float32))
    assert not wants_huge_pages(big) and not wants_huge_pages(big.reshape(2, -1)[1])
    held = arena.empty((4, 8), np.float32)
    assert not wants_huge_pages(held) and not wants_huge_pages(held[1:])
    dev = get_device("cpu")
    assert dev.weights(held) is held


def test_memory_mapped_file_is_copied(tmp_path):
    from freetoken.device.hugepages import wants_huge_pages

    path = tmp_path / "w.bin"
    np.arange(4096, dtype=np.float32).tofile(path)
    mapped = np.memmap(path, dtype=np.float32, mode="r").reshape(64, 64)
    assert wants_huge_pages(mapped)
    placed = get_device("cpu").weights(mapped)
    np.testing.assert_array_equal(placed, mapped)
    assert not wants_huge_pages(placed)
