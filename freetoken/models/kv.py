"""The paged KV cache: one pool of fixed-size blocks per device, and sequences that address it through a block table.

:class:`KVPool` owns every layer's keys and values as ``[layers, num_blocks, block_size, Hkv, D]`` arrays in the
storage dtype of a KV kind (float32, float16, bf16 as uint16 bits, fp8 e4m3 as uint8 with float32 scales
``[layers, num_blocks, block_size, Hkv]``: the contract of ``ops.kv_store`` / ``ops.paged_attention``), a free list
and a reference count per block. :class:`KVSequence` is one token sequence: its blocks in position order, mirrored
in an int32 block table on the device that the ops read, grown as the sequence grows.

Blocks are reference-counted so that sequences can share them: :meth:`KVSequence.fork` gives a second sequence the
same full blocks without copying them (a prompt prefix shared by two conversations, a snapshot to return to). A
shared block is never written: before a sequence writes into a block that another sequence holds too, it copies the
block into one of its own (copy on write; only the last, partial block of a sequence can be written).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

#: Tokens per block: 64 keeps the waste of a sequence's last block under 64 tokens and the block table short
#: (512 entries at 32k tokens), while one block of one kv head (64 x D values) is a whole tile for the attention
#: kernels to read.
KV_BLOCK_TOKENS = 64

#: Version of the pool's layout (``[layers, num_blocks, block_size, Hkv, D]`` per array, K then V, fp8 scales
#: ``[layers, num_blocks, block_size, Hkv]``): a saved snapshot of blocks (an anchor) records it, and one of another
#: layout is refused. Raise it whenever the layout or a kind's encoding changes.
KV_LAYOUT_VERSION = 1

#: KV kind -> storage dtype of the pool arrays (the ops' contract).
KV_DTYPES: dict[str, type] = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "fp8": np.uint8}
#: The KV kinds, default first.
KV_KINDS = ("bf16", "f16", "f32", "fp8")


class OutOfKVBlocks(ValueError):
    """The pool has fewer free blocks than a sequence needs."""


def kv_token_bytes(num_layers: int, kv_heads: int, head_dim: int, kind: str, values: bool = True) -> int:
    """Bytes one token takes in the pool over all layers, K and V (fp8: its per-(token, head) scales included;
    ``values`` False: the keys alone, as a latent-attention pool holds them)."""
    if kind not in KV_DTYPES:
        raise ValueError(f"KV kind {kind!r}: choose one of {', '.join(KV_KINDS)}")
    per_head = head_dim * np.dtype(KV_DTYPES[kind]).itemsize + (4 if kind == "fp8" else 0)
    return (2 if values else 1) * num_layers * kv_heads * per_head


def kv_block_bytes(num_layers: int, kv_heads: int, head_dim: int, kind: str,
                   block_size: int = KV_BLOCK_TOKENS, values: bool = True) -> int:
    """Bytes of one block of the pool (all layers, K and V, scales included)."""
    return block_size * kv_token_bytes(num_layers, kv_heads, head_dim, kind, values)


class LayerKV(NamedTuple):
    """What one layer's attention hands the ops: its slice of the pool and the sequence's block table."""

    k: object  # [num_blocks, block_size, Hkv, D]
    v: object
    k_scale: object | None  # [num_blocks, block_size, Hkv] float32 (fp8), else None
    v_scale: object | None
    block_table: object  # int32 [capacity blocks] on the device


class KVPool:
    """``num_blocks`` blocks of ``block_size`` tokens for ``num_layers`` layers of ``kv_heads`` x ``head_dim`` keys
    and values, stored as ``kind`` (see :data:`KV_DTYPES`), on ``device``. ``values`` False: keys only (``v`` and
    ``v_scale`` are None): a latent-attention pool, whose one row per token holds what keys and values are made
    from (``ops.latent_store`` / ``ops.latent_attention``)."""

    def __init__(self, device, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, kind: str = "bf16",
                 block_size: int = KV_BLOCK_TOKENS, values: bool = True):
        if kind not in KV_DTYPES:
            raise ValueError(f"KV kind {kind!r}: choose one of {', '.join(KV_KINDS)}")
        for name, n in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"KV pool: {name} must be a whole number >= 1, got {n!r}")
        self.dev, self.kind = device, kind
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        shape = (num_layers, self.num_blocks, block_size, kv_heads, head_dim)
        self.values = bool(values)
        self.k = device.zeros(shape, KV_DTYPES[kind])
        self.v = device.zeros(shape, KV_DTYPES[kind]) if values else None
        self.k_scale = self.v_scale = None
        if kind == "fp8":
            self.k_scale = device.zeros(shape[:-1], np.float32)
            self.v_scale = device.zeros(shape[:-1], np.float32) if values else None
        self.refs = np.zeros(self.num_blocks, np.int32)  # holders of each block (0: free)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # a stack: the lowest free block comes out first
        #: called in order, round after round, with the number of blocks still missing when an allocation finds
        #: too few free, until enough are free or a whole round does nothing: each returns how much it did (blocks
        #: freed or references dropped) and may give blocks back (a prefix cache evicts what nobody else holds; an
        #: anchor store spills an anchor to host memory, which can leave a block to the prefix cache alone, so
        #: that the next round evicts it)
        self.reclaimers: list = []

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds on its device."""
        return sum(int(a.nbytes) for a in (self.k, self.v, self.k_scale, self.v_scale) if a is not None)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.num_blocks * self.block_size

    def layer(self, i: int, block_table) -> LayerKV:
        """Layer ``i``'s slice of the pool with a sequence's ``block_table``."""
        return LayerKV(self.k[i], None if self.v is None else self.v[i],
                       None if self.k_scale is None else self.k_scale[i],
                       None if self.v_scale is None else self.v_scale[i], block_table)

    # ---- blocks ------------------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, each now held once; :class:`OutOfKVBlocks` (nothing taken) when fewer are free even
        after the :attr:`reclaimers` gave back what they could."""
        while n > len(self._free) and any(reclaim(n - len(self._free)) for reclaim in self.reclaimers
                                          if n > len(self._free)):
            pass
        if n > len(self._free):
            raise OutOfKVBlocks(f"the KV pool is out of blocks: {n} more needed, {len(self._free)} of "
                                f"{self.num_blocks} free ({self.block_size} tokens each)")
        got = [self._free.pop() for _ in range(n)]
        self.refs[got] = 1
        return got

    def retain(self, blocks) -> None:
        """One more holder of each of ``blocks`` (every one must be held already)."""
        blocks = np.asarray(blocks, np.int64).reshape(-1)
        if blocks.size and (self.refs[blocks] <= 0).any():
            raise ValueError(f"retain of free KV blocks {sorted(set(blocks[self.refs[blocks] <= 0].tolist()))}")
        np.add.at(self.refs, blocks, 1)

    def release(self, blocks) -> None:
        """One holder fewer of each of ``blocks``; a block nobody holds goes back to the free list."""
        blocks = np.asarray(blocks, np.int64).reshape(-1)
        if not blocks.size:
            return
        counts = np.bincount(blocks, minlength=self.num_blocks)
        over = np.nonzero(counts > self.refs)[0]
        if over.size:
            raise ValueError(f"release of KV blocks not held (that often): {over.tolist()}")
        self.refs -= counts.astype(np.int32)
        # freed blocks are pushed highest first, so the stack hands the lowest out first
        self._free.extend(sorted(np.nonzero((counts > 0) & (self.refs == 0))[0].tolist(), reverse=True))

    @property
    def arrays(self) -> dict:
        """The pool's arrays by name (``k``, ``v``, and ``k_scale``/``v_scale`` for fp8), in a fixed order."""
        named = {"k": self.k, "v": self.v, "k_scale": self.k_scale, "v_scale": self.v_scale}
        return {name: a for name, a in named.items() if a is not None}

    def read_rows(self, blocks, rows) -> list[dict[str, np.ndarray]]:
        """Host copies of the first ``rows[i]`` rows of each of ``blocks`` (every layer, K, V and scales): one
        ``{name: [layers, rows[i], ...]}`` a block, read in one transfer per array."""
        if not len(blocks):
            return []
        idx = self.dev.asarray(np.asarray(blocks, np.int64))
        whole = {name: self.dev.to_host(a[:, idx]) for name, a in self.arrays.items()}
        return [{name: np.ascontiguousarray(v[:, i, :r]) for name, v in whole.items()} for i, r in enumerate(rows)]

    def write_rows(self, block: int, data: dict[str, np.ndarray]) -> None:
        """Put rows shaped as :meth:`read_rows` gives them into the first rows of ``block``."""
        for name, a in self.arrays.items():
            a[:, block, :data[name].shape[1]] = self.dev.asarray(data[name])

    def copy_block(self, src: int, dst: int, rows: int | None = None) -> None:
        """Rows ``0 .. rows - 1`` (default all) of block ``src`` into block ``dst``, every layer, K, V and scales."""
        r = self.block_size if rows is None else rows
        for a in (self.k, self.v, self.k_scale, self.v_scale):
            if a is not None:
                a[:, dst, :r] = a[:, src, :r]


class KVSequence:
    """One sequence in ``pool``: ``length`` tokens in ``blocks`` (position ``p`` in ``blocks[p // block_size]``),
    mirrored in ``block_table``, an int32 device array of ``capacity`` tokens' worth of entries (entries past the
    sequence's blocks are not read)."""

    def __init__(self, pool: KVPool, capacity: int):
        if capacity < 1:
            raise ValueError(f"a KV sequence needs a capacity >= 1 token, got {capacity}")
        self.pool, self.capacity = pool, int(capacity)
        n = -(-self.capacity // pool.block_size)
        self._table = np.zeros(n, np.int32)  # host mirror of block_table
        self.block_table = pool.dev.asarray(self._table)
        self.blocks: list[int] = []
        self.length = 0

    def layer(self, i: int) -> LayerKV:
        return self.pool.layer(i, self.block_table)

    @property
    def host_table(self) -> np.ndarray:
        """The host mirror of ``block_table`` (read-only view)."""
        view = self._table.view()
        view.flags.writeable = False
        return view

    def _sync(self, first: int) -> None:
        """Upload the table entries from block ``first`` on (what changed)."""
        n = len(self.blocks)
        if first < n:
            self._table[first:n] = self.blocks[first:]
            self.block_table[first:n] = self.pool.dev.asarray(self._table[first:n])

    def prepare(self, start: int, count: int) -> None:
        """Make positions ``start .. start + count - 1`` writable: blocks allocated up to there, and the blocks those
        positions fall in held by this sequence alone (a shared one is copied first). ``start`` <= ``length``."""
        bs = self.pool.block_size
        end = start + count
        if start > self.length:
            raise ValueError(f"a write at position {start} would leave a gap after the sequence's {self.length} "
                             "tokens")
        if end > self.capacity:
            raise ValueError(f"a sequence of {end} tokens exceeds the context of {self.capacity} tokens")
        if count <= 0:
            return
        have, need = len(self.blocks), -(-end // bs)
        first_write = start // bs
        shared = [i for i in range(first_write, min(have, need)) if self.pool.refs[self.blocks[i]] > 1]
        new = self.pool.allocate(need - have + len(shared)) if need > have or shared else []
        for i in shared:  # copy on write: this sequence takes a private copy of a block others hold
            dst = new.pop()
            self.pool.copy_block(self.blocks[i], dst, rows=start - i * bs if i == first_write else bs)
            self.pool.release([self.blocks[i]])
            self.blocks[i] = dst
        self.blocks.extend(new)
        self._sync(min([have, *shared]))

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens; blocks past them go back to the pool."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length} tokens: the sequence holds {self.length}")
        keep = -(-length // self.pool.block_size)
        self.pool.release(self.blocks[keep:])
        del self.blocks[keep:]
        self.length = int(length)

    def reset(self) -> None:
        """An empty sequence: every block released."""
        self.truncate(0)

    def adopt(self, blocks, length: int) -> None:
        """Become the sequence of ``length`` tokens held in ``blocks`` (position order; the caller's references stay
        the caller's: this sequence retains its own). Its earlier blocks are released. A shared last block, partly
        filled, is copied before this sequence writes into it (:meth:`prepare`)."""
        blocks = [int(b) for b in blocks]
        bs = self.pool.block_size
        if length > self.capacity:
            raise ValueError(f"a sequence of {length} tokens exceeds the context of {self.capacity} tokens")
        if len(blocks) != -(-length // bs):
            raise ValueError(f"{length} tokens take {-(-length // bs)} blocks of {bs}, not {len(blocks)}")
        self.pool.retain(blocks)  # first: a block both old and new must not pass through the free list
        self.pool.release(self.blocks)
        self.blocks, self.length = blocks, int(length)
        self._sync(0)

    def own_last(self) -> None:
        """Copy a shared, partly filled last block into one of this sequence's own now, not at the first write: the
        shared one is then free to be evicted by its other holder before the next forward pass allocates its blocks
        (a copy at that write would need one block more than the sequence at the moment of the copy)."""
        bs = self.pool.block_size
        if self.length % bs and self.blocks and self.pool.refs[self.blocks[-1]] > 1:
            (dst,) = self.pool.allocate(1)
            self.pool.copy_block(self.blocks[-1], dst, rows=self.length % bs)
            self.pool.release([self.blocks[-1]])
            self.blocks[-1] = dst
            self._sync(len(self.blocks) - 1)

    def fork(self) -> KVSequence:
        """A second sequence with the same tokens: the full blocks shared (retained, not copied), a partial last
        block copied into a block of its own (the two sequences then write their own continuations)."""
        bs = self.pool.block_size
        full = self.length // bs
        twin = KVSequence(self.pool, self.capacity)
        tail = self.length - full * bs
        own = self.pool.allocate(1) if tail else []
        self.pool.retain(self.blocks[:full])
        twin.blocks = self.blocks[:full] + own
        if tail:
            self.pool.copy_block(self.blocks[full], own[0], rows=tail)
        twin.length = self.length
        twin._sync(0)
        return twin
