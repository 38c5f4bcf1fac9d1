"""Semantic anchors: verified snapshots of a sequence's KV state at a message boundary, to return to later.

An :class:`Anchor` is the exact token ids of a prefix, the KV blocks that hold their keys and values, and what a
restore must check: the model's fingerprint (:mod:`freetoken.engine.fingerprint`), the KV kind and the pool's
layout, and checksums of the KV bytes taken when the anchor was made (xxh3-64 per block over the anchor's rows of
every layer's K, V and fp8 scales; the anchor's checksum is xxh3-128 over those). Its id is the BLAKE3-256 of the
fingerprint and the token ids, so a request can name the anchors its own message boundaries would have.

:class:`AnchorStore` keeps anchors in three tiers:

* **device**: the anchor holds references to its blocks in the pool (they outlive the sequence and the prefix
  cache's eviction), up to ``device_blocks`` blocks in all; past that, or when the pool runs short of blocks
  (the store is one of the pool's reclaimers), the least recently used ones spill to
* **host**: a copy of the blocks' bytes in (pinned, on gpu) host memory, up to ``host_bytes``; past that they go
  to
* **disk** (``directory`` given): one file each, written atomically (a temporary file, fsync, rename). With a
  directory every anchor is written when it is made, so a restarted server finds them: the files are indexed at
  start (a torn file, a foreign one, one of another model or whose id does not match its tokens is refused there),
  their bytes read and checked at restore. Without one, the oldest host anchors are dropped.

:meth:`AnchorStore.restore` uses an anchor only after every check passes: same fingerprint, KV kind and layout;
the stored token ids equal the request's prefix exactly (an id match alone never suffices, so a hash collision
cannot restore the wrong state); the KV bytes match their checksums: every block for an anchor read back from host
memory or disk, ``sample_blocks`` blocks (the last one, and others drawn at random) for one still on the device
(each sampled block is one block-sized read to the host and an xxh3 pass over it). A failed check refuses the
anchor, logs why, keeps the reason in :attr:`AnchorStore.refusals`, and the caller recomputes.
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

#: Anchor file: magic, format version, header length, JSON header, payload (token ids, then the arrays), and an
#: xxh3-128 of everything before it (a torn or altered file fails it).
FILE_MAGIC = b"FTANCHOR"
FILE_VERSION = 1
FILE_SUFFIX = ".fta"
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
            f"dim{pool.head_dim}")


def block_sums(data: dict[str, np.ndarray], length: int, block_size: int) -> list[int]:
    """xxh3-64 of each block's first rows (the anchor's ``length`` tokens) over every array of ``data``
    (``{name: [layers, blocks, block_size, ...]}``, in the pool's order)."""
    import xxhash

    n = -(-length // block_size)
    out = []
    for j in range(n):
        rows = min(block_size, length - j * block_size)
        h = xxhash.xxh3_64()
        for a in data.values():
            h.update(np.ascontiguousarray(a[:, j, :rows]).view(np.uint8).reshape(-1))
        out.append(h.intdigest())
    return out


def total_sum(sums: Sequence[int], length: int) -> str:
    import xxhash

    return xxhash.xxh3_128(np.asarray([length, *sums], np.uint64).astype("<u8").tobytes()).hexdigest()


@dataclass(eq=False)
class Anchor:
    """One anchor; ``blocks`` (device tier), ``host`` (host tier) or ``path`` (disk only) says where its KV is."""

    id: str
    tokens: np.ndarray  # int32, the exact prefix
    fingerprint: str
    kv_kind: str
    layout: str
    checksum: str
    sums: list[int]
    residency: list[int] | None = None  # expert records resident in the expert cache when it was made
    label: str | None = None
    created: float = field(default_factory=time.time)
    last_use: float = field(default_factory=time.monotonic)
    blocks: list[int] | None = None
    host: dict | None = None
    path: Path | None = None
    _pinned: list = field(default_factory=list, repr=False)  # owners of pinned host memory (gpu)

    @property
    def length(self) -> int:
        return int(self.tokens.size)

    @property
    def tier(self) -> str:
        return "device" if self.blocks is not None else "host" if self.host is not None else "disk"

    def info(self) -> dict:
        """What the HTTP API lists."""
        return {"id": self.id, "object": "anchor", "tokens": self.length, "tier": self.tier,
                "on_disk": self.path is not None, "kv_dtype": self.kv_kind, "label": self.label,
                "created": int(self.created), "checksum": self.checksum}


class AnchorStore:
    """The anchors of one model (``fingerprint``) over ``pool``; see the module doc for the tiers and checks."""

    def __init__(self, pool: KVPool, fingerprint: str, directory: str | os.PathLike | None = None,
                 device_blocks: int | None = None, host_bytes: int = 2 << 30,
                 sample_blocks: int = DEFAULT_SAMPLE_BLOCKS, seed: int = 0):
        self.pool, self.fingerprint = pool, fingerprint
        self.layout = pool_layout(pool)
        self.device_blocks = pool.num_blocks // 2 if device_blocks is None else int(device_blocks)
        self.host_bytes, self.sample_blocks = int(host_bytes), int(sample_blocks)
        self.anchors: dict[str, Anchor] = {}
        self.refusals: list[tuple[str, str]] = []  # (anchor id, why), most recent last
        self.restored = 0
        self._rng = np.random.default_rng(seed)
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._index_directory()
        pool.reclaimers.append(self.spill)

    # ---- making ------------------------------------------------------------------------------------------------
    def create(self, seq: KVSequence, tokens: Sequence[int], length: int | None = None, *, label: str | None = None,
               residency: list[int] | None = None) -> Anchor:
        """The anchor of the first ``length`` tokens (default all) of ``seq``, whose token ids are ``tokens``.
        An anchor of the same prefix already here is returned (and marked used) instead of a second one."""
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
        blocks = seq.blocks[:-(-length // self.pool.block_size)]
        data = self.pool.read_blocks(blocks)
        sums = block_sums(data, length, self.pool.block_size)
        anchor = Anchor(aid, toks, self.fingerprint, self.pool.kind, self.layout, total_sum(sums, length), sums,
                        residency=residency, label=label)
        self.pool.retain(blocks)
        anchor.blocks = list(blocks)
        self.anchors[aid] = anchor
        if self.directory is not None:
            self._write(anchor, data)
        self._enforce_budgets(keep=anchor)
        return anchor

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
        if drop == "entry" or (drop == "all" and bad is not None and bad.id != aid):
            bad = self.anchors.pop(aid, None)
            if bad is not None and bad.id not in self.anchors and bad.blocks is not None:
                self.pool.release(bad.blocks)
                bad.blocks = None
        elif drop == "all":
            self.delete(aid)
        return 0, why

    def check(self, anchor: Anchor, ids: Sequence[int]) -> tuple[str | None, str | None]:
        """(why ``anchor`` cannot serve a request for ``ids``, what to drop: see :meth:`_refuse`); (None, None): it
        can, as far as its header goes."""
        if anchor.fingerprint != self.fingerprint:
            return "it was made by another model (weights fingerprint differs)", "entry"
        if anchor.kv_kind != self.pool.kind:
            return f"its KV is {anchor.kv_kind}, this pool stores {self.pool.kind}", "entry"
        if anchor.layout != self.layout:
            return f"its KV layout {anchor.layout} is not this pool's {self.layout}", "entry"
        if anchor.id != anchor_id(self.fingerprint, anchor.tokens):
            return "its id does not match its token ids", "all"
        n = anchor.length
        if len(ids) < n or not np.array_equal(np.asarray(ids[:n], np.int64), anchor.tokens.astype(np.int64)):
            return f"its {n} token ids are not a prefix of the request's {len(ids)} tokens", None
        return None, None

    def restore(self, anchor: Anchor | str, ids: Sequence[int], seq: KVSequence,
                limit: int | None = None) -> tuple[int, str | None]:
        """Make ``seq`` the anchor's prefix of ``ids`` (at most ``limit`` tokens of it) after every check; returns
        (tokens restored, None) or (0, why it was refused: ``seq`` is then left as it was)."""
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
        if anchor.blocks is None:  # host or disk: every block checked before any of it is used
            data, why = self._read_back(anchor)
            if why is not None:
                return self.refuse(aid, why, "all")
            blocks = self.pool.allocate(len(anchor.sums))
            self.pool.write_blocks(blocks, data)
            anchor.blocks, anchor.host, anchor._pinned = blocks, None, []
        else:
            n_blocks = len(anchor.blocks)
            k = min(n_blocks - 1, max(0, self.sample_blocks - 1))  # the last block, and k others at random
            pick = [n_blocks - 1, *self._rng.choice(n_blocks - 1, size=k, replace=False).tolist()]
            for j in pick:
                rows = min(bs, anchor.length - j * bs)
                got = block_sums({k: v[:, :, :rows] for k, v in self.pool.read_blocks([anchor.blocks[j]]).items()},
                                 rows, bs)[0]
                if got != anchor.sums[j]:
                    return self.refuse(aid, f"the KV bytes of block {j} changed since it was made (checksum "
                                        "mismatch on the device)", "all")
        n = anchor.length if limit is None else min(anchor.length, int(limit))
        seq.adopt(anchor.blocks[:-(-n // bs)], n)
        anchor.last_use = time.monotonic()
        self.restored += 1
        self._enforce_budgets(keep=anchor)
        return n, None

    def _read_back(self, anchor: Anchor) -> tuple[dict | None, str | None]:
        """The host copy of a host or disk anchor, its every block checked; (None, why) when it fails."""
        if anchor.host is not None:
            data = anchor.host
        else:
            try:
                header, tokens, data = read_file(anchor.path)
            except (OSError, ValueError) as e:
                return None, f"its file {anchor.path} cannot be used: {e}"
            if not np.array_equal(tokens, anchor.tokens):
                return None, f"its file {anchor.path} holds other token ids"
        sums = block_sums(data, anchor.length, self.pool.block_size)
        bad = [j for j, (a, b) in enumerate(zip(sums, anchor.sums, strict=True)) if a != b]
        if bad or total_sum(sums, anchor.length) != anchor.checksum:
            return None, f"the KV bytes of block(s) {bad} do not match the checksum taken when it was made"
        return data, None

    def delete(self, aid: str) -> bool:
        """Forget an anchor (its blocks, host copy and file); False when there is none of that id."""
        anchor = self.anchors.pop(aid, None)
        if anchor is None:
            return False
        if anchor.blocks is not None:
            self.pool.release(anchor.blocks)
        anchor.blocks = anchor.host = None
        if anchor.path is not None:
            anchor.path.unlink(missing_ok=True)
        return True

    def clear(self) -> None:
        for aid in list(self.anchors):
            self.delete(aid)

    def list(self) -> list[Anchor]:
        return sorted(self.anchors.values(), key=lambda a: a.created)

    def held_blocks(self) -> list[int]:
        return [b for a in self.anchors.values() if a.blocks is not None for b in a.blocks]

    # ---- tiers -------------------------------------------------------------------------------------------------
    def _to_host(self, anchor: Anchor) -> None:
        data = self.pool.read_blocks(anchor.blocks)
        if self.pool.dev.kind == "gpu":  # page-locked, so that a restore copies at full PCIe speed
            pinned = {k: self.pool.dev.pinned_empty(v.shape, v.dtype) for k, v in data.items()}
            for k, v in data.items():
                pinned[k].host[...] = v
            anchor._pinned = list(pinned.values())
            data = {k: p.host for k, p in pinned.items()}
        self.pool.release(anchor.blocks)
        anchor.blocks, anchor.host = None, data

    def _host_bytes(self) -> int:
        return sum(int(v.nbytes) for a in self.anchors.values() if a.host is not None for v in a.host.values())

    def _enforce_budgets(self, keep: Anchor | None = None) -> None:
        by_age = sorted(self.anchors.values(), key=lambda a: a.last_use)
        held = sum(len(a.blocks) for a in by_age if a.blocks is not None)
        for a in by_age:
            if held <= self.device_blocks:
                break
            if a.blocks is not None and a is not keep:
                held -= len(a.blocks)
                self._to_host(a)
        host = self._host_bytes()
        for a in by_age:
            if host <= self.host_bytes:
                break
            if a.host is not None and a is not keep:
                host -= sum(int(v.nbytes) for v in a.host.values())
                if a.path is not None:  # on disk already: the host copy goes
                    a.host, a._pinned = None, []
                else:
                    self.delete(a.id)

    def spill(self, n: int) -> int:
        """Reclaimer of the pool: move least recently used device anchors to host memory until ``n`` of their
        blocks are free (a block the prefix cache or a sequence still holds is not freed by it); returns blocks
        freed."""
        freed = 0
        for a in sorted((a for a in self.anchors.values() if a.blocks is not None), key=lambda a: a.last_use):
            if freed >= n:
                break
            freed += int((self.pool.refs[a.blocks] == 1).sum())
            self._to_host(a)
        if freed:
            self._enforce_budgets()
        return freed

    # ---- disk --------------------------------------------------------------------------------------------------
    def _write(self, anchor: Anchor, data: dict) -> None:
        header = {"id": anchor.id, "fingerprint": anchor.fingerprint, "kv_kind": anchor.kv_kind,
                  "layout": anchor.layout, "length": anchor.length, "checksum": anchor.checksum,
                  "sums": [str(s) for s in anchor.sums], "residency": anchor.residency, "label": anchor.label,
                  "created": anchor.created}
        anchor.path = write_file(self.directory / f"{anchor.id}{FILE_SUFFIX}", header, anchor.tokens, data)

    def _index_directory(self) -> None:
        """Register the anchor files of the directory (headers and token ids only; the KV is read at restore)."""
        for path in sorted(self.directory.glob(f"*{FILE_SUFFIX}")):
            try:
                header, tokens = read_file(path, payload=False)
            except (OSError, ValueError) as e:
                self.refuse(path.stem, f"file {path} refused on load: {e}")
                continue
            if header.get("fingerprint") != self.fingerprint:
                self.refuse(path.stem, f"file {path} refused on load: it was made by another model")
                continue
            if header.get("id") != anchor_id(self.fingerprint, tokens) or path.stem != header.get("id"):
                self.refuse(path.stem, f"file {path} refused on load: its id does not match its token ids")
                continue
            self.anchors[header["id"]] = Anchor(
                header["id"], tokens, header["fingerprint"], header["kv_kind"], header["layout"],
                header["checksum"], [int(s) for s in header["sums"]], residency=header.get("residency"),
                label=header.get("label"), created=float(header.get("created", 0.0)), path=path)


def write_file(path: Path, header: dict, tokens: np.ndarray, data: dict[str, np.ndarray]) -> Path:
    """Write an anchor file atomically: a temporary file in the same directory, fsync, rename, fsync the
    directory. A crash leaves the old file or the new one, never a torn one under the final name."""
    import xxhash

    header = dict(header, arrays=[[k, str(v.dtype), list(v.shape)] for k, v in data.items()])
    head = json.dumps(header, sort_keys=True).encode()
    h = xxhash.xxh3_128()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=FILE_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in (_PREFIX.pack(FILE_MAGIC, FILE_VERSION, len(head)), head,
                         np.ascontiguousarray(tokens, "<i4").tobytes(),
                         *(np.ascontiguousarray(v).view(np.uint8).reshape(-1) for v in data.values())):
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


def read_file(path: Path, payload: bool = True):
    """(header, token ids[, arrays]) of an anchor file; ValueError naming what is wrong (not an anchor file,
    another format version, torn or altered)."""
    import xxhash

    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise ValueError("too short to be an anchor file")
        magic, version, hlen = _PREFIX.unpack(prefix)
        if magic != FILE_MAGIC:
            raise ValueError("not a freetoken anchor file")
        if version != FILE_VERSION:
            raise ValueError(f"anchor file version {version}, this freetoken reads {FILE_VERSION}")
        head = f.read(hlen)
        try:
            header = json.loads(head)
            length = int(header["length"])
            arrays = [(k, np.dtype(d), tuple(int(x) for x in s)) for k, d, s in header["arrays"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"its header is damaged ({e})") from None
        body = 4 * length + sum(int(np.prod(s)) * d.itemsize for _, d, s in arrays)
        if size != _PREFIX.size + hlen + body + 16:
            raise ValueError(f"{size} bytes where its header says {_PREFIX.size + hlen + body + 16} (torn or "
                             "truncated)")
        raw_tokens = f.read(4 * length)
        tokens = np.frombuffer(raw_tokens, "<i4").astype(np.int32)
        if not payload:
            return header, tokens
        h = xxhash.xxh3_128()
        h.update(prefix)
        h.update(head)
        h.update(raw_tokens)
        data = {}
        for k, d, s in arrays:
            buf = f.read(int(np.prod(s)) * d.itemsize)
            h.update(buf)
            data[k] = np.frombuffer(buf, d).reshape(s)
        if f.read(16) != h.digest():
            raise ValueError("its file checksum does not match (altered or torn)")
    return header, tokens, data
