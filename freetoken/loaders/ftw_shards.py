"""Sharded FTW sets (docs/ftw.md, "Shards"): one model in files ``NAME-00001-of-0000N.ftw`` ..., each an FTW file
of its own (preamble, whole tensors and records, an index with their checksums). Every shard's index names the set
(a random id) and its place in it; shard 1's index also holds the model's side (config, tokenizer, chat template)
and a table of the other shards (byte size, index checksum).

This module names a set's files, finds a set from any of its paths (a shard, or the name it was written as), and
opens its files, refusing with a :class:`LoadError` naming the file a missing shard, a shard of another set, and
a shard that is not the one shard 1's table describes. What the shards hold (no tensor or record twice, every
expert present) is checked by :class:`freetoken.loaders.ftw_file.FTWFile`.
"""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass
from pathlib import Path

from freetoken.loaders.errors import LoadError
from freetoken.loaders.ftw_file import FilePart, _hex128, _int

#: A shard's file name; the digits are at least five wide (wider only past 99999 shards).
SHARD_NAME = re.compile(r"(?P<base>.+)-(?P<number>\d{5,})-of-(?P<count>\d{5,})\.ftw")


@dataclass(frozen=True)
class ShardInfo:
    """A shard's ``shard`` entry: which set, and its place in it."""

    set_id: str
    number: int  # from 1
    count: int


def set_base(path: Path) -> str:
    """What the names of the set written as ``path`` start with: ``model`` for ``model.ftw`` (or ``model``)."""
    return path.name[:-len(".ftw")] if path.name.endswith(".ftw") else path.name


def shard_path(directory: Path, base: str, number: int, count: int) -> Path:
    return directory / f"{base}-{number:05d}-of-{count:05d}.ftw"


def parse_shard_name(path: Path) -> tuple[str, int, int] | None:
    """(base, number, count) of a shard's file name, or None for another name."""
    m = SHARD_NAME.fullmatch(path.name)
    return None if m is None else (m["base"], int(m["number"]), int(m["count"]))


def set_files(path: Path) -> list[Path]:
    """Every shard file, of any count, of sets written as ``path`` (what a conversion to ``path`` replaces)."""
    base = set_base(path)
    found = []
    for p in path.parent.glob(f"{glob.escape(base)}-*-of-*.ftw"):
        parsed = parse_shard_name(p)
        if parsed is not None and parsed[0] == base:
            found.append(p)
    return sorted(found)


def first_shards(path: Path) -> list[Path]:
    """Shard 1 of each set written as ``path`` (normally one; two after a set of another count was left beside)."""
    return [p for p in set_files(path) if parse_shard_name(p)[1] == 1]


def resolve(path: Path) -> Path:
    """The file to open for ``path``: itself when it exists, else shard 1 of the one set written as ``path``."""
    if path.exists():
        return path
    found = first_shards(path)
    if not found:
        raise LoadError(str(path), "no such file, and no sharded set of that name (NAME-00001-of-0000N.ftw)")
    if len(found) > 1:
        raise LoadError(str(path), f"names {len(found)} sharded sets ({', '.join(p.name for p in found)}); open "
                                   "one by its shard file")
    return found[0]


def shard_info(part: FilePart) -> ShardInfo | None:
    """The ``shard`` entry of a file's index; None for a whole model in one file."""
    s = part.index.get("shard")
    if s is None:
        return None
    try:
        if not isinstance(s, dict):
            raise ValueError("shard must be an object {set, number, count}")
        info = ShardInfo(_hex128(s.get("set"), "shard.set"), _int(s.get("number"), "shard.number", 1),
                         _int(s.get("count"), "shard.count", 2))
        if info.number > info.count:
            raise ValueError(f"shard {info.number} of {info.count}")
    except ValueError as e:
        raise LoadError(str(part.path), f"malformed index: {e}", "index") from None
    return info


def _named_as(part: FilePart, info: ShardInfo) -> str:
    """The set's base name; a shard whose file name does not say its place is refused (the others are found by
    their names)."""
    parsed = parse_shard_name(part.path)
    if parsed is None or parsed[1:] != (info.number, info.count):
        raise LoadError(str(part.path), f"its index says shard {info.number} of {info.count} of a set, but it is "
                                        f"not named NAME-{info.number:05d}-of-{info.count:05d}.ftw, so the other "
                                        "shards cannot be found")
    return parsed[0]


def _table(first: FilePart, count: int) -> list[tuple[int, str]]:
    """Shard 1's table: (bytes, index xxh3) of shards 2 .. count."""
    table = first.index.get("shards")
    try:
        if not isinstance(table, list) or len(table) != count - 1:
            raise ValueError(f"shards must describe the other {count - 1} shards")
        out = []
        for k, e in enumerate(table, start=2):
            if not isinstance(e, dict) or e.get("number") != k:
                raise ValueError(f"shards[{k - 2}] must describe shard {k}")
            out.append((_int(e.get("bytes"), f"shards[{k - 2}].bytes"),
                        _hex128(e.get("index_xxh3"), f"shards[{k - 2}].index_xxh3")))
    except ValueError as e:
        raise LoadError(str(first.path), f"malformed index: {e}", "index") from None
    return out


def open_parts(path: Path) -> list[FilePart]:
    """The files of the model at ``path``: [the file] for a whole model in one; for a set (``path`` any of its
    shards, or the name it was written as) every shard in order, shard 1 first, checked against shard 1's table."""
    part = FilePart(resolve(path))
    info = shard_info(part)
    if info is None:
        return [part]
    base = _named_as(part, info)
    if info.number != 1:  # the set is read from shard 1, which holds the model's side and the table
        part.close()
        first = shard_path(part.path.parent, base, 1, info.count)
        if not first.is_file():
            raise LoadError(str(first), f"missing: shard 1 of {info.count}, which holds the model's config")
        part = FilePart(first)
        info = shard_info(part)
        if info is None:
            raise LoadError(str(first), "a whole model in one file, named as shard 1 of a set")
        _named_as(part, info)
    parts = [part]
    for k, (nbytes, index_sum) in enumerate(_table(part, info.count), start=2):
        p = shard_path(part.path.parent, base, k, info.count)
        if not p.is_file():
            raise LoadError(str(p), f"missing: shard {k} of {info.count} of the set {part.path.name} begins")
        shard = FilePart(p)  # its own preamble is checked first: a truncated shard is refused as truncated
        got = shard_info(shard)
        if got is None or got.set_id != info.set_id:
            theirs = "no set (a whole model)" if got is None else f"set {got.set_id}"
            raise LoadError(str(p), f"not a shard of this set: its index names {theirs}, {part.path.name} names set "
                                    f"{info.set_id} (a file from another conversion)")
        if (got.number, got.count) != (k, info.count):
            raise LoadError(str(p), f"its index says shard {got.number} of {got.count}, its name shard {k} of "
                                    f"{info.count}")
        if shard.size != nbytes:
            raise LoadError(str(p), f"the file is {shard.size} bytes, shard 1's table says {nbytes}")
        if shard.index_sum != index_sum:
            raise LoadError(str(p), f"its index (xxh3 {shard.index_sum}) is not the one shard 1's table names "
                                    f"({index_sum}): the shard was rewritten after the set was written", "index")
        parts.append(shard)
    return parts
