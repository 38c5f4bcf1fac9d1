"""Semantic anchors: verified snapshots of a sequence's KV state at a message boundary, to return to later.

An :class:`Anchor` is the exact token ids of a prefix, the KV blocks that hold their keys and values, and what a
restore must check: the model's fingerprint (:mod:`freetoken.engine.reuse.fingerprint`), the KV kind and the pool's
layout, and checksums of the KV bytes taken when the anchor was made (xxh3-128 per block over the anchor's rows of
every layer's K, V and fp8 scales; the anchor's checksum is xxh3-128 over those). Its id is the BLAKE3-256 of the
fingerprint and the token ids, so a request can name the anchors its own message boundaries would have.

A model with linear-attention layers (Qwen3-Next, Qwen3.5-MoE; a store made with ``states=True``) cannot resume from
KV rows alone: its anchors also hold the layers' recurrent and convolution states at the prefix's end
(:meth:`freetoken.models.decoder.MoeDecoder.export_states`), with their own xxh3-128 (``state_sum``, part of the
anchor's checksum). The states are one per anchor, not shared like blocks: they stay in host memory while the
anchor is on the device or in host memory (they count against ``host_bytes``), and go to disk in a state file named
by their checksum; a restore checks them like a block read back, before anything is adopted.

:class:`AnchorStore` keeps anchors in three tiers, block by block: the anchors of one conversation are prefixes of
each other and share most of their blocks, so every tier holds a block once, however many anchors name it.

* **device**: the anchor holds references to its blocks in the pool (they outlive the sequence and the prefix
  cache's eviction), up to ``device_blocks`` distinct blocks in all; past that, or when the pool runs short of
  blocks (the store is one of the pool's reclaimers), the least recently used ones spill to
* **host**: copies of the blocks' bytes in (pinned, on gpu) host memory, keyed by their checksum, up to
  ``host_bytes``; past that the least recently used anchors leave host memory, for
* **disk** (``directory`` given): an anchor file (header and token ids) and one file per block, named by its
  checksum, under ``blocks/``; each written atomically (a temporary file, fsync, rename), every anchor when it is
  made, so a restarted server finds them. The anchor files are read and checked at start (a torn file, a foreign
  one, one of another model or whose id does not match its tokens is refused there), the block files at restore.
  Without a directory, an anchor leaving host memory is gone.

:meth:`AnchorStore.restore` uses an anchor only after every check passes: same fingerprint, KV kind and layout;
the stored token ids equal the request's prefix exactly (an id match alone never suffices, so a hash collision
cannot restore the wrong state); the KV bytes match their checksums: every block for an anchor read back from host
memory or disk, ``sample_blocks`` blocks (the last one, and others drawn at random) for one still on the device
(each sampled block is one block-sized read to the host and an xxh3 pass over it: ~0.2 MB for the bundled model,
~4.5 MB for DeepSeek-V3's latent cache, tens of microseconds to a millisecond). A failed check refuses the anchor,
logs why, keeps the reason in :attr:`AnchorStore.refusals`, and the caller recomputes; an anchor whose bytes or id
are bad leaves the store (and the disk), so the next request at that prefix makes a sound one.

Making an anchor reads to the host and hashes only the blocks no other device anchor already holds (a full block
an anchor holds is never written again: a sequence that shares it copies it first), so a conversation's anchors
cost about one pass over its KV in all, not one per anchor.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from freetoken.models.kv import KV_LAYOUT_VERSION, KVPool, KVSequence

log = logging.getLogger("freetoken.anchors")

#: Anchor file: magic, format version, header length, JSON header, token ids, and an xxh3-128 of everything before
#: it (a torn or altered file fails it). Block files: the same frame with their own magic, the rows of every array.
FILE_MAGIC = b"FTANCHOR"
BLOCK_MAGIC = b"FTKVBLCK"
STATE_MAGIC = b"FTLSTATE"
FILE_VERSION = 2
FILE_SUFFIX = ".fta"
BLOCK_SUFFIX = ".kvb"
STATE_SUFFIX = ".lss"
_PREFIX = struct.Struct("<8sII")
#: Blocks checked at a restore from the device tier (the last block always among them).
DEFAULT_SAMPLE_BLOCKS = 2


def anchor_id(fingerprint: str, tokens: Sequence[int]) -> str:
    """The 256-bit id (hex BLAKE3) of the prefix ``tokens`` of the model ``fingerprint``."""
    import blake3

    h = blake3.blake3(f"freetoken-anchor:{fingerprint}:".encode())
    h.update(np.asarray(tokens, np.int64).astype("<i4").tobytes())
    return h.hexdigest()


def pool_layout(pool: KVPool) -> str:
    """The pool's layout in one string: what an anchor's blocks must be read back into."""
    return (f"v{KV_LAYOUT_VERSION}:blocks{pool.block_size}:layers{pool.num_layers}:heads{pool.kv_heads}:"
            f"dim{pool.head_dim}" + ("" if pool.values else ":keys-only"))


def block_sum(data: dict[str, np.ndarray]) -> str:
    """xxh3-128 (hex) of one block's rows: ``{name: [layers, rows, ...]}`` in the pool's array order."""
    import xxhash

    h = xxhash.xxh3_128()
    for a in data.values():
        h.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1))
    return h.hexdigest()


def state_sum(arrays: dict[str, np.ndarray]) -> str:
    """xxh3-128 (hex) of linear-attention states ``{name: array}``: names, shapes and bytes, in name order (a file
    read back gives the same sum whatever order it stored them in)."""
    import xxhash

    h = xxhash.xxh3_128()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{list(a.shape)};".encode())
        h.update(a.view(np.uint8).reshape(-1))
    return h.hexdigest()


def total_sum(sums: Sequence[str], length: int, states: str | None = None) -> str:
    """The anchor's checksum: xxh3-128 over its length, its blocks' checksums and its states' (when it has them)."""
    import xxhash

    tail = "" if states is None else f":states={states}"
    return xxhash.xxh3_128(f"{length}:{','.join(sums)}{tail}".encode()).hexdigest()


def _rows(length: int, j: int, block_size: int) -> int:
    """Rows of block ``j`` that belong to a prefix of ``length`` tokens."""
    return min(block_size, length - j * block_size)


@dataclass(eq=False)
class Anchor:
    """One anchor. ``where``: "device" (``blocks`` holds its pool blocks), "host" (its blocks' bytes are in the
    store's host copies) or "disk" (only in its files); ``path``: its anchor file, when it has one."""

    id: str
    tokens: np.ndarray  # int32, the exact prefix
    fingerprint: str
    kv_kind: str
    layout: str
    checksum: str
    sums: list[str]  # per block, xxh3-128 hex
    residency: list[int] | None = None  # expert records resident in the expert cache when it was made
    state_sum: str | None = None  # its linear-attention states' checksum (models with linear-attention layers)
    label: str | None = None
    created: float = field(default_factory=time.time)
    last_use: float = field(default_factory=time.monotonic)
    blocks: list[int] | None = None
    where: str = "device"
    path: Path | None = None

    @property
    def length(self) -> int:
        return int(self.tokens.size)

    @property
    def tier(self) -> str:
        return self.where

    def info(self) -> dict:
        """What the HTTP API lists."""
        return {"id": self.id, "object": "anchor", "tokens": self.length, "tier": self.where,
                "on_disk": self.path is not None, "kv_dtype": self.kv_kind, "label": self.label,
                "linear_states": self.state_sum is not None,
                "created": int(self.created), "checksum": self.checksum}


class AnchorStore:
    """The anchors of one model (``fingerprint``) over ``pool``; see the module doc for the tiers and checks.
    ``states``: the model has linear-attention layers, so every anchor carries their states."""

    def __init__(self, pool: KVPool, fingerprint: str, directory: str | os.PathLike | None = None,
                 device_blocks: int | None = None, host_bytes: int = 2 << 30,
                 sample_blocks: int = DEFAULT_SAMPLE_BLOCKS, seed: int = 0, states: bool = False):
        self.pool, self.fingerprint, self.states = pool, fingerprint, bool(states)
        self.layout = pool_layout(pool)
        self.device_blocks = pool.num_blocks // 2 if device_blocks is None else int(device_blocks)
        self.host_bytes, self.sample_blocks = int(host_bytes), int(sample_blocks)
        self.anchors: dict[str, Anchor] = {}
        self.refusals: list[tuple[str, str]] = []  # (anchor id, why), most recent last
        self.restored = 0
        self._rng = np.random.default_rng(seed)
        self._host: dict[str, list] = {}  # block checksum -> [rows {name: array}, anchors holding it, owners]
        self._disk: dict[str, int] = {}  # block checksum -> anchor files naming it
        self._state_host: dict[str, dict] = {}  # anchor id -> its linear-attention states, while in memory
        self._state_disk: dict[str, int] = {}  # state checksum -> anchor files naming it
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            (self.directory / "blocks").mkdir(parents=True, exist_ok=True)
            self._index_directory()
        pool.reclaimers.append(self.spill)

    # ---- making ------------------------------------------------------------------------------------------------
    def create(self, seq: KVSequence, tokens: Sequence[int], length: int | None = None, *, label: str | None = None,
               residency: list[int] | None = None, states: dict[str, np.ndarray] | None = None) -> Anchor:
        """The anchor of the first ``length`` tokens (default all) of ``seq``, whose token ids are ``tokens``;
        ``states``: the linear-attention states at its end (host arrays the store now owns), which a store made
        with ``states=True`` requires and any other refuses. An anchor of the same prefix already here is returned
        (and marked used) instead of a second one."""
        bs = self.pool.block_size
        length = len(tokens) if length is None else int(length)
        if not 1 <= length <= min(len(tokens), seq.length):
            raise ValueError(f"an anchor of {length} tokens: the sequence holds {seq.length} ({len(tokens)} ids "
                             "given)")
        toks = np.asarray(tokens[:length], np.int64).astype(np.int32)
        aid = anchor_id(self.fingerprint, toks)
        have = self.anchors.get(aid)
        if have is not None and np.array_equal(have.tokens, toks):
            have.last_use = time.monotonic()
            if label and not have.label:
                have.label = label
            return have
        if self.states != (states is not None):
            raise ValueError("anchors of this model need its linear-attention states" if self.states else
                             "this model has no linear-attention states to keep in an anchor")
        blocks = [int(b) for b in seq.blocks[:-(-length // bs)]]
        known = self._device_sums()
        sums: list[str | None] = [known.get(b) if _rows(length, j, bs) == bs else None for j, b in enumerate(blocks)]
        data = self._read_rows(blocks, [j for j, v in enumerate(sums) if v is None], length)
        for j, rows in data.items():
            sums[j] = block_sum(rows)
        ssum = state_sum(states) if states is not None else None
        anchor = Anchor(aid, toks, self.fingerprint, self.pool.kind, self.layout, total_sum(sums, length, ssum),
                        list(sums), residency=residency, label=label, state_sum=ssum)
        self.pool.retain(blocks)
        anchor.blocks = blocks
        self.anchors[aid] = anchor
        if states is not None:
            self._state_host[aid] = dict(states)
        if self.directory is not None:
            self._write(anchor, data)
        self._enforce_budgets(keep=anchor)
        return anchor

    def _read_rows(self, blocks: Sequence[int], js: Sequence[int], length: int) -> dict[int, dict]:
        """Host copies of the rows of blocks ``js`` (indices into ``blocks``) that a prefix of ``length`` tokens
        fills: ``{j: {name: [layers, rows, ...]}}``."""
        bs = self.pool.block_size
        return dict(zip(js, self.pool.read_rows([blocks[j] for j in js], [_rows(length, j, bs) for j in js]),
                        strict=True))

    def _device_sums(self) -> dict[int, str]:
        """Pool block -> checksum, for the full blocks device anchors hold (unchanged while they hold them)."""
        bs = self.pool.block_size
        return {b: a.sums[j] for a in self.anchors.values() if a.blocks is not None
                for j, b in enumerate(a.blocks) if _rows(a.length, j, bs) == bs}

    # ---- lookup and restore ----------------------------------------------------------------------------------
    def get(self, aid: str) -> Anchor | None:
        return self.anchors.get(aid)

    def best_prefix(self, ids: Sequence[int], boundaries: Sequence[int]) -> str | None:
        """The id of the longest anchor among the prefixes ``ids[:b]`` for ``b`` in ``boundaries`` (found by id:
        :meth:`restore` still checks the tokens), or None."""
        for b in sorted({int(b) for b in boundaries if 0 < b <= len(ids)}, reverse=True):
            aid = anchor_id(self.fingerprint, ids[:b])
            if aid in self.anchors:
                return aid
        return None

    def refuse(self, aid: str, why: str, drop: str | None = None) -> tuple[int, str]:
        """Log and keep why ``aid`` was refused. ``drop="entry"``: the store forgets it (an anchor of another KV
        kind or layout, filed under an id not its own; a file stays on disk for whoever can use it); ``"all"``: the
        anchor itself is bad (its bytes, its id) and goes with its file, so the next request at that prefix makes a
        sound one."""
        log.warning("anchor %s refused: %s", aid[:16], why)
        self.refusals.append((aid, why))
        del self.refusals[:-64]
        bad = self.anchors.get(aid)
        if bad is not None and (drop == "entry" or (drop == "all" and bad.id != aid)):
            del self.anchors[aid]
            if bad.id not in self.anchors:
                self._let_go(bad)
        elif drop == "all":
            self.delete(aid)
        return 0, why

    def check(self, anchor: Anchor, ids: Sequence[int]) -> tuple[str | None, str | None]:
        """(why ``anchor`` cannot serve a request for ``ids``, what to drop: see :meth:`refuse`); (None, None): it
        can, as far as its header goes."""
        if anchor.fingerprint != self.fingerprint:
            return "it was made by another model (weights fingerprint differs)", "entry"
        if anchor.kv_kind != self.pool.kind:
            return f"its KV is {anchor.kv_kind}, this pool stores {self.pool.kind}", "entry"
        if anchor.layout != self.layout:
            return f"its KV layout {anchor.layout} is not this pool's {self.layout}", "entry"
        if self.states != (anchor.state_sum is not None):
            return ("it holds no linear-attention states, which this model needs" if self.states else
                    "it holds linear-attention states, which this model has not"), "entry"
        if anchor.id != anchor_id(self.fingerprint, anchor.tokens):
            return "its id does not match its token ids", "all"
        if total_sum(anchor.sums, anchor.length, anchor.state_sum) != anchor.checksum:
            return "its block checksums do not add up to its checksum", "all"
        n = anchor.length
        if len(ids) < n or not np.array_equal(np.asarray(ids[:n], np.int64), anchor.tokens.astype(np.int64)):
            return f"its {n} token ids are not a prefix of the request's {len(ids)} tokens", None
        return None, None

    def restore(self, anchor: Anchor | str, ids: Sequence[int], seq: KVSequence, limit: int | None = None,
                have: Sequence[int] = (), have_tokens: int = 0,
                states_out: dict | None = None) -> tuple[int, str | None]:
        """Make ``seq`` the anchor's prefix of ``ids`` (at most ``limit`` tokens of it) after every check; returns
        (tokens restored, None) or (0, why it was refused: ``seq`` is then left as it was). An anchor with
        linear-attention states restores only whole (they hold its last token) and puts the checked states in
        ``states_out`` for the caller to import.

        ``have``: blocks the caller holds for the first ``have_tokens`` of ``ids`` (a prefix-cache match): the
        whole ones among them serve as they are, and only the anchor's blocks past them are read back from host
        memory or disk (into new blocks of ``seq``; the anchor stays in its tier)."""
        aid = None
        if isinstance(anchor, str):
            aid, anchor = anchor, self.anchors.get(anchor)
            if anchor is None:
                return self.refuse(aid, "no such anchor")
        aid = anchor.id if aid is None else aid
        why, drop = self.check(anchor, ids)
        if why is not None:
            if aid != anchor.id and aid in self.anchors:
                drop = "entry"  # filed under an id not its own (a collision, or a forged entry): that entry goes
            return self.refuse(aid, why, drop)
        bs = self.pool.block_size
        n = anchor.length if limit is None else min(anchor.length, int(limit))
        n_blocks = -(-n // bs)
        states = None
        if anchor.state_sum is not None:
            if n < anchor.length:
                return 0, f"its states hold {anchor.length} tokens, only {n} of them can be reused here"
            states, why = self._states_of(anchor)
            if why is not None:
                return self.refuse(aid, why, "all")
        if anchor.blocks is not None:
            why = self._sample(anchor)
            if why is not None:
                return self.refuse(aid, why, "all")
            seq.adopt(anchor.blocks[:n_blocks], n)
        else:
            skip = min(n_blocks, min(int(have_tokens), n) // bs, len(have))
            rows, why = self._read_back(anchor, skip, n_blocks)
            if why is not None:
                return self.refuse(aid, why, "all")
            new = self.pool.allocate(len(rows))
            for b, data in zip(new, rows, strict=True):
                self.pool.write_rows(b, data)
            seq.adopt([*have[:skip], *new], n)
            self.pool.release(new)  # the sequence holds them now
        if states is not None:
            if anchor.where != "disk":  # in memory again with its blocks
                self._state_host[anchor.id] = states
            if states_out is not None:
                states_out.update(states)
        anchor.last_use = time.monotonic()
        self.restored += 1
        self._enforce_budgets(keep=anchor)
        return n, None

    def _sample(self, anchor: Anchor) -> str | None:
        """Check a device anchor's last block and ``sample_blocks - 1`` others drawn at random."""
        n_blocks = len(anchor.blocks)
        k = min(n_blocks - 1, max(0, self.sample_blocks - 1))
        picked = [n_blocks - 1, *self._rng.choice(n_blocks - 1, size=k, replace=False).tolist()]
        for j, rows in self._read_rows(anchor.blocks, picked, anchor.length).items():
            if block_sum(rows) != anchor.sums[j]:
                return f"the KV bytes of block {j} changed since it was made (checksum mismatch on the device)"
        return None

    def _states_of(self, anchor: Anchor) -> tuple[dict | None, str | None]:
        """The anchor's linear-attention states from host memory or its state file, checked: (arrays, None) or
        (None, why)."""
        arrays = self._state_host.get(anchor.id)
        if arrays is None:
            if self.directory is None or anchor.path is None:
                return None, "its linear-attention states are neither in host memory nor on disk"
            try:
                _, arrays = read_frame(self._state_path(anchor.state_sum), STATE_MAGIC)
            except (OSError, ValueError) as e:
                return None, f"its linear-attention states: {e}"
            arrays = {k: np.array(v) for k, v in arrays.items()}
        if state_sum(arrays) != anchor.state_sum:
            return None, "its linear-attention states do not match the checksum taken when it was made"
        return arrays, None

    def _read_back(self, anchor: Anchor, first: int, stop: int) -> tuple[list | None, str | None]:
        """Blocks ``first .. stop - 1`` of a host or disk anchor, each checked against its checksum: (rows, None)
        or (None, why). A disk anchor's blocks stay in host memory after (its tier becomes host)."""
        bs = self.pool.block_size
        out, loaded = [], {}
        for j in range(first, stop):
            key = anchor.sums[j]
            entry = self._host.get(key)
            if entry is not None and anchor.where == "host":
                data = entry[0]
            else:
                try:
                    data = entry[0] if entry is not None else (
                        read_block(self._block_path(key)) if self.directory is not None else None)
                except (OSError, ValueError) as e:
                    return None, f"block {j}: {e}"
                if data is None:
                    return None, f"block {j} is neither in host memory nor on disk"
                loaded[key] = data
            if block_sum(data) != key or next(iter(data.values())).shape[1] != _rows(anchor.length, j, bs):
                return None, f"the KV bytes of block {j} do not match the checksum taken when it was made"
            out.append(data)
        if anchor.where == "disk" and first == 0 and stop == len(anchor.sums):  # all of it read: keep it at hand
            for key, data in loaded.items():
                self._host.setdefault(key, [{k: np.array(v) for k, v in data.items()}, 0, []])
            for key in anchor.sums:
                self._host[key][1] += 1
            anchor.where = "host"
        return out, None

    # ---- letting go --------------------------------------------------------------------------------------------
    def _let_go(self, anchor: Anchor) -> None:
        """Release what an anchor holds in the pool and in host memory (not its files)."""
        if anchor.blocks is not None:
            self.pool.release(anchor.blocks)
            anchor.blocks = None
        self._drop_host(anchor)
        self._state_host.pop(anchor.id, None)

    def delete(self, aid: str) -> bool:
        """Forget an anchor (its blocks, host copies and files); False when there is none of that id."""
        anchor = self.anchors.pop(aid, None)
        if anchor is None:
            return False
        if anchor.id != aid and anchor.id in self.anchors:  # an entry under another id: the anchor stays
            return True
        self._let_go(anchor)
        if anchor.path is not None:
            anchor.path.unlink(missing_ok=True)
            anchor.path = None
            for key in anchor.sums:
                self._disk[key] -= 1
                if not self._disk[key]:
                    del self._disk[key]
                    self._block_path(key).unlink(missing_ok=True)
            key = anchor.state_sum
            if key is not None and key in self._state_disk:
                self._state_disk[key] -= 1
                if not self._state_disk[key]:
                    del self._state_disk[key]
                    self._state_path(key).unlink(missing_ok=True)
        return True

    def clear(self) -> None:
        """Delete every anchor (blocks, host copies and files)."""
        for aid in list(self.anchors):
            self.delete(aid)

    def close(self) -> None:
        """Let go of the pool (every device block, every host copy) and stop reclaiming for it; files stay."""
        for a in {id(a): a for a in self.anchors.values()}.values():  # (one filed under two ids: once)
            self._let_go(a)
        self.pool.reclaimers.remove(self.spill)

    def list(self) -> list[Anchor]:
        return sorted(self.anchors.values(), key=lambda a: a.created)

    def held_blocks(self) -> list[int]:
        """Every pool block the anchors hold a reference to (once per holding anchor)."""
        return [b for a in self.anchors.values() if a.blocks is not None for b in a.blocks]

    # ---- tiers -------------------------------------------------------------------------------------------------
    def _to_host(self, anchor: Anchor) -> None:
        """Move a device anchor's blocks to host memory (a block already there is shared, not copied again)."""
        missing = [j for j, key in enumerate(anchor.sums) if key not in self._host]
        for j, rows in self._read_rows(anchor.blocks, missing, anchor.length).items():
            owners = []
            if self.pool.dev.kind == "gpu":  # page-locked, so that a restore copies at full PCIe speed
                pinned = {k: self.pool.dev.pinned_empty(v.shape, v.dtype) for k, v in rows.items()}
                for k, v in rows.items():
                    pinned[k].host[...] = v
                owners, rows = list(pinned.values()), {k: q.host for k, q in pinned.items()}
            self._host[anchor.sums[j]] = [rows, 0, owners]
        for key in anchor.sums:
            self._host[key][1] += 1
        self.pool.release(anchor.blocks)
        anchor.blocks, anchor.where = None, "host"

    def _drop_host(self, anchor: Anchor) -> None:
        """The anchor lets go of its host copies (they go when no anchor holds them), its states included."""
        if anchor.where != "host":
            return
        self._state_host.pop(anchor.id, None)
        for key in anchor.sums:
            entry = self._host[key]
            entry[1] -= 1
            if not entry[1]:
                del self._host[key]
        anchor.where = "disk"

    def host_bytes_held(self) -> int:
        """Host memory of the blocks' copies and of the anchors' linear-attention states."""
        blocks = sum(int(v.nbytes) for rows, _, _ in self._host.values() for v in rows.values())
        return blocks + sum(int(v.nbytes) for arrays in self._state_host.values() for v in arrays.values())

    def _enforce_budgets(self, keep: Anchor | None = None) -> None:
        """Device anchors over ``device_blocks`` distinct blocks spill to host, least recently used first (the
        newest too when it alone is over: the prefix cache still has its blocks while nobody needs the room);
        host copies over ``host_bytes`` go, least recently used first, except ``keep``'s (a device anchor's
        linear-attention states are host memory too: such an anchor leaves the device for its files, or goes)."""
        by_age = sorted(self.anchors.values(), key=lambda a: a.last_use)
        for a in by_age:
            if len(set(self.held_blocks())) <= self.device_blocks:
                break
            if a.blocks is not None:
                self._to_host(a)
        for a in by_age:
            if self.host_bytes_held() <= self.host_bytes:
                break
            if a is keep or a.where == "disk" or (a.where == "device" and a.id not in self._state_host):
                continue  # no host memory to give back
            if a.path is None:
                self.delete(a.id)
            elif a.where == "host":
                self._drop_host(a)  # on disk: only the host copy goes
            else:  # a device anchor with states: to its files as a whole (no copy to host memory on the way)
                self._let_go(a)
                a.where = "disk"

    def spill(self, n: int) -> int:
        """Reclaimer of the pool: move the least recently used device anchor to host memory; returns the references
        it dropped (0: no device anchor is left). A block the prefix cache also holds is not free yet: the pool's
        next round of reclaimers evicts it."""
        device = [a for a in self.anchors.values() if a.blocks is not None]
        if not device:
            return 0
        a = min(device, key=lambda a: a.last_use)
        dropped = len(a.blocks)
        self._to_host(a)
        self._enforce_budgets()
        return dropped

    # ---- disk --------------------------------------------------------------------------------------------------
    def _block_path(self, key: str) -> Path:
        return self.directory / "blocks" / f"{key}{BLOCK_SUFFIX}"

    def _state_path(self, key: str) -> Path:
        return self.directory / "blocks" / f"{key}{STATE_SUFFIX}"

    def _write(self, anchor: Anchor, data: dict[int, dict]) -> None:
        """The anchor's file, and the files of those of its blocks no file holds yet (``data``: rows read at
        creation; a block not among them is read from the pool now)."""
        bs = self.pool.block_size
        need = [j for j, key in enumerate(anchor.sums) if key not in self._disk and j not in data]
        data.update(self._read_rows(anchor.blocks, need, anchor.length))
        for j, key in enumerate(anchor.sums):
            if key not in self._disk:
                write_frame(self._block_path(key), BLOCK_MAGIC, {"rows": _rows(anchor.length, j, bs)},
                            list(data[j].values()), list(data[j]))
            self._disk[key] = self._disk.get(key, 0) + 1
        key = anchor.state_sum
        if key is not None:
            if key not in self._state_disk:
                arrays = self._state_host[anchor.id]
                write_frame(self._state_path(key), STATE_MAGIC, {}, list(arrays.values()), list(arrays))
            self._state_disk[key] = self._state_disk.get(key, 0) + 1
        header = {"id": anchor.id, "fingerprint": anchor.fingerprint, "kv_kind": anchor.kv_kind,
                  "layout": anchor.layout, "length": anchor.length, "checksum": anchor.checksum,
                  "sums": anchor.sums, "residency": anchor.residency, "label": anchor.label,
                  "created": anchor.created, "state_sum": anchor.state_sum}
        anchor.path = write_frame(self.directory / f"{anchor.id}{FILE_SUFFIX}", FILE_MAGIC, header,
                                  [anchor.tokens.astype("<i4")], ["tokens"])

    def _index_directory(self) -> None:
        """Register the anchor files of the directory, each checked whole (they are small: the KV is in the block
        files, read and checked at restore)."""
        for path in sorted(self.directory.glob(f"*{FILE_SUFFIX}")):
            try:
                header, arrays = read_frame(path, FILE_MAGIC)
                tokens = arrays["tokens"].astype(np.int32)
                sums = [str(x) for x in header["sums"]]
                fields = {k: str(header[k]) for k in ("id", "fingerprint", "kv_kind", "layout", "checksum")}
            except (OSError, ValueError, KeyError, TypeError) as e:
                self.refuse(path.stem, f"file {path} refused on load: {e}")
                continue
            if header["fingerprint"] != self.fingerprint:
                self.refuse(path.stem, f"file {path} refused on load: it was made by another model")
                continue
            if header["id"] != anchor_id(self.fingerprint, tokens) or path.stem != header["id"]:
                self.refuse(path.stem, f"file {path} refused on load: its id does not match its token ids")
                continue
            ssum = header.get("state_sum")
            self.anchors[header["id"]] = Anchor(**fields, tokens=tokens, sums=sums, where="disk", path=path,
                                                residency=header.get("residency"), label=header.get("label"),
                                                created=float(header.get("created", 0.0)),
                                                state_sum=None if ssum is None else str(ssum))
            for key in sums:
                self._disk[key] = self._disk.get(key, 0) + 1
            if ssum is not None:
                self._state_disk[str(ssum)] = self._state_disk.get(str(ssum), 0) + 1


def write_frame(path: Path, magic: bytes, header: dict, arrays: list[np.ndarray], names: list[str]) -> Path:
    """Write a file atomically: a temporary file in the same directory, fsync, rename, fsync the directory (a
    crash leaves the old file or the new one, never a torn one under the final name). The frame: ``magic``, the
    format version, the JSON header (with the arrays' names, dtypes and shapes), the arrays' bytes, and an xxh3-128
    of all that."""
    import xxhash

    header = dict(header, arrays=[[n, str(a.dtype), list(a.shape)] for n, a in zip(names, arrays, strict=True)])
    head = json.dumps(header, sort_keys=True).encode()
    h = xxhash.xxh3_128()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in (_PREFIX.pack(magic, FILE_VERSION, len(head)), head,
                         *(np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in arrays)):
                h.update(part)
                f.write(part)
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


def read_frame(path: Path, magic: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, {name: array}) of a file :func:`write_frame` wrote with ``magic``; ValueError saying what is wrong
    (not such a file, another format version, torn or altered)."""
    import xxhash

    raw = path.read_bytes()
    if len(raw) < _PREFIX.size + 16:
        raise ValueError("too short to be a freetoken anchor file")
    got_magic, version, hlen = _PREFIX.unpack_from(raw)
    if got_magic != magic:
        raise ValueError(f"not a freetoken anchor {'block ' if magic == BLOCK_MAGIC else ''}file")
    if version != FILE_VERSION:
        raise ValueError(f"anchor file version {version}, this freetoken reads {FILE_VERSION}")
    try:
        header = json.loads(raw[_PREFIX.size:_PREFIX.size + hlen])
        specs = [(n, np.dtype(d), tuple(int(x) for x in s)) for n, d, s in header["arrays"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"its header is damaged ({e})") from None
    body = sum(int(np.prod(s)) * d.itemsize for _, d, s in specs)
    if len(raw) != _PREFIX.size + hlen + body + 16:
        raise ValueError(f"{len(raw)} bytes where its header says {_PREFIX.size + hlen + body + 16} (torn or "
                         "truncated)")
    if xxhash.xxh3_128(raw[:-16]).digest() != raw[-16:]:
        raise ValueError("its file checksum does not match (altered or torn)")
    arrays, at = {}, _PREFIX.size + hlen
    for n, d, s in specs:
        size = int(np.prod(s)) * d.itemsize
        arrays[n] = np.frombuffer(raw, d, count=int(np.prod(s)), offset=at).reshape(s)
        at += size
    return header, arrays


def read_block(path: Path) -> dict[str, np.ndarray]:
    """The rows of a block file (checked whole; its checksum against its name is the caller's check)."""
    return read_frame(path, BLOCK_MAGIC)[1]
