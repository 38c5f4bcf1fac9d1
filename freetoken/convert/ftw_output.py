"""Where :func:`freetoken.convert.ftw_export.write_ftw` puts its bytes: one FTW file, or a set of shards
(docs/ftw.md, "Shards") each holding whole tensors and records up to a size.

Items go into the current file in order; one that would take a shard past the size starts the next, and one
larger than the size gets a shard of its own, so nothing is ever split across files. The indexes are written
once every item is: they name the shard count, and shard 1's holds the others' sizes and index checksums. The
files are temporary until :func:`freetoken.convert.atomic.atomic_set` renames them all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from freetoken.convert.atomic import PartialSet
from freetoken.loaders.ftw_file import ALIGN, aligned, checksum, write_preamble
from freetoken.loaders.ftw_shards import set_base, shard_path


def check_shard_bytes(shard_bytes: int | None) -> None:
    if shard_bytes is not None and (not isinstance(shard_bytes, int) or shard_bytes < 2 * ALIGN):
        raise ValueError(f"a shard size must be at least {2 * ALIGN} bytes (a preamble and a page), got "
                         f"{shard_bytes!r}")


@dataclass
class Shard:
    """One file being written: its temporary path, where its next item goes, and its index's tables."""

    path: Path
    at: int = ALIGN
    tensors: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)


class FTWOutput:
    """The file (``shard_bytes`` None) or shards being written through ``files``."""

    def __init__(self, files: PartialSet, shard_bytes: int | None = None):
        check_shard_bytes(shard_bytes)
        self.files, self.limit = files, shard_bytes
        self.shards: list[Shard] = []
        self._f = None

    def put(self, *parts: bytes | np.ndarray) -> tuple[Shard, int, int]:
        """Write ``parts`` as one item at the next aligned offset of the current shard (or of a new one);
        (its shard, offset, bytes)."""
        views = [memoryview(np.ascontiguousarray(p)).cast("B") if isinstance(p, np.ndarray) else memoryview(p)
                 for p in parts]
        n = sum(v.nbytes for v in views)
        cur = self.shards[-1] if self.shards else None
        if cur is None or (self.limit is not None and cur.at > ALIGN and cur.at + n > self.limit):
            cur = self._next_shard()
        self._f.seek(cur.at)
        for v in views:
            self._f.write(v)
        offset, cur.at = cur.at, aligned(cur.at + n)
        return cur, offset, n

    def _next_shard(self) -> Shard:
        if self._f is not None:
            self._f.close()
        shard = Shard(self.files.new())
        self._f = open(shard.path, "w+b")
        self.shards.append(shard)
        return shard

    def finish(self, head: dict, model: dict, out: Path) -> list[Path]:
        """Write every file's index (``head``: format, version, writer; ``model``: the model's side, for the only
        file or shard 1) and preamble; returns the names the files take (also given to ``files.targets``)."""
        if not self.shards:
            self._next_shard()
        self.abandon()
        first, rest = self.shards[0], self.shards[1:]
        if not rest:  # everything fit in one file: a plain FTW file, no set
            _close(first, {**head, **model, "tensors": first.tensors, "records": first.records})
            self.files.targets = [Path(out)]
            return self.files.targets
        set_id, count = os.urandom(16).hex(), len(self.shards)
        table = []
        for k, s in enumerate(rest, start=2):
            nbytes, index_sum = _close(s, {**head, "shard": {"set": set_id, "number": k, "count": count},
                                           "tensors": s.tensors, "records": s.records})
            table.append({"number": k, "bytes": nbytes, "index_xxh3": index_sum})
        _close(first, {**head, "shard": {"set": set_id, "number": 1, "count": count}, **model, "shards": table,
                       "tensors": first.tensors, "records": first.records})
        out = Path(out)
        self.files.targets = [shard_path(out.parent, set_base(out), k, count) for k in range(1, count + 1)]
        return self.files.targets

    def abandon(self) -> None:
        """Close the open file (after the last item, or on an error: the atomic write removes the temporary
        files)."""
        if self._f is not None:
            self._f.close()
            self._f = None


def _close(shard: Shard, index: dict) -> tuple[int, str]:
    """Append ``index`` to the shard's file and write its preamble; (file bytes, index xxh3)."""
    raw = json.dumps(index, separators=(",", ":")).encode()
    sum_ = checksum(raw)
    with open(shard.path, "r+b") as f:
        f.seek(shard.at)
        f.write(raw)
        end = shard.at + len(raw)
        f.truncate(end)
        write_preamble(f, shard.at, len(raw), sum_, end)
    return end, sum_
