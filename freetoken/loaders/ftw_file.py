"""FTW files: freetoken's own weight file, one record per routed expert (the spec: docs/ftw.md).

A file is a 4 KiB preamble, the non-expert tensors, the expert records and, last, a JSON index; every tensor and
record starts on a 4 KiB boundary. The preamble points at the index and holds its xxh3-128; the index holds the
model config, the tokenizer, the chat template and the table of tensors and records, each with its own xxh3-128.
A record is a 64-byte header (layer, expert, format codes, payload size, checksum) then the expert's banks in the
host pool's record layout, so loading an expert is one contiguous read and one copy.

:class:`FTWFile` reads and checks the preamble and the index at once (version, sizes, bounds, overlaps, that every
MoE layer has all its experts) and refuses a bad file with a :class:`LoadError` naming the file and the tensor or
record. Checksums are verified as data is read (``verify``: "full" every tensor and record, "sample" every
tensor and one record in 16, "none").

A big model is a set of shards, each an FTW file of this structure holding whole tensors and records
(:mod:`.ftw_shards` finds and ties them together); :class:`FTWFile` reads a set as one model, each tensor and
record from the file that holds it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from freetoken.formats.table import FTW_CODES
from freetoken.loaders.errors import LoadError

MAGIC = b"FTWF"
RECORD_MAGIC = b"FTWR"
#: The one version this freetoken reads and writes.
VERSION = 1
#: Every tensor, record and the index start at a multiple of this (a page; O_DIRECT and GPU-direct reads want it).
ALIGN = 4096
#: magic, version, index offset, index bytes, index xxh3-128, file bytes, alignment.
PREAMBLE = struct.Struct("<4sIQQ16sQI")
#: magic, version, gate/up format code, down format code, flags (bit 0: biases), layer, expert, payload bytes.
RECORD_FIELDS = struct.Struct("<4sHHHHIIQ")
#: The record header: its fields, zeros to byte 48, then the xxh3-128 of bytes 0-48 and the payload.
RECORD_HEADER_BYTES = 64
_CHECKSUM_AT = 48
#: Stable codes of the expert formats in record headers (never renumbered; new formats take new codes): a column
#: of the format table.
FORMAT_CODES = FTW_CODES
FORMAT_NAMES = {v: k for k, v in FORMAT_CODES.items()}
#: Float storages of non-expert tensors and their NumPy dtypes (bf16 as uint16 bits).
FLOAT_STORAGES = {"bf16": np.dtype(np.uint16), "f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}
#: One record in 16 is verified with verify="sample".
SAMPLE_EVERY = 16
VERIFY_MODES = ("full", "sample", "none")


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def checksum(*parts) -> str:
    """xxh3-128 of the concatenated byte buffers, as 32 hex digits."""
    import xxhash

    h = xxhash.xxh3_128()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def record_header(fmt: str, down_fmt: str, bias: bool, layer: int, expert: int, payload_bytes: int) -> bytes:
    """The 48 bytes of a record header before its checksum."""
    fields = RECORD_FIELDS.pack(RECORD_MAGIC, VERSION, FORMAT_CODES[fmt], FORMAT_CODES[down_fmt], int(bias),
                                layer, expert, payload_bytes)
    return fields + b"\0" * (_CHECKSUM_AT - len(fields))


@dataclass(frozen=True)
class TensorEntry:
    name: str
    storage: str  # "bf16" | "f16" | "f32" | a QuantizedMatrix kind ("q4_k", "fp8_block", ...)
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    xxh3: str
    shard: int = 0  # which file of a sharded set holds it (0: the first, or the only one)


@dataclass(frozen=True)
class RecordEntry:
    layer: int
    expert: int
    fmt: str
    down_fmt: str
    offset: int
    nbytes: int  # header + payload
    xxh3: str
    shard: int = 0

    @property
    def what(self) -> str:
        return f"expert record (layer {self.layer}, expert {self.expert})"


def _hex128(v, what: str) -> str:
    if not isinstance(v, str) or len(v) != 32 or any(c not in "0123456789abcdef" for c in v):
        raise ValueError(f"{what} must be 32 lowercase hex digits, got {v!r:.40}")
    return v


def _int(v, what: str, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < 2**62:
        raise ValueError(f"{what} must be an integer in [{lo}, 2^62), got {v!r:.40}")
    return v


class FilePart:
    """One file of a model (the whole model, or one shard of a set): its preamble checked, its index's checksum
    verified and its JSON parsed, its bytes mapped. What the index holds is checked by :class:`FTWFile`."""

    def __init__(self, path: Path):
        self.path = path
        where = str(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                pre = f.read(PREAMBLE.size)
        except OSError as e:
            raise LoadError(where, f"cannot read the file ({e.strerror or e})") from None
        if len(pre) < PREAMBLE.size or pre[:4] != MAGIC:
            raise LoadError(where, "not an FTW file (no FTWF magic at its start)")
        magic, version, index_offset, index_bytes, index_sum, file_bytes, align = PREAMBLE.unpack(pre)
        if version != VERSION:
            raise LoadError(where, f"FTW version {version}; this freetoken reads version {VERSION} only")
        if align != ALIGN:
            raise LoadError(where, f"alignment {align} in the preamble; version {VERSION} files use {ALIGN}")
        if size != file_bytes:
            raise LoadError(where, f"the file is {size} bytes, its preamble says {file_bytes}: truncated, or "
                                   "something was appended")
        if index_offset % ALIGN or index_offset < ALIGN or index_offset + index_bytes > size:
            raise LoadError(where, f"the index ({index_bytes} bytes at {index_offset}) is not inside the file")
        self.map = np.memmap(path, dtype=np.uint8, mode="r")
        raw = self.map[index_offset:index_offset + index_bytes]
        self.index_sum = checksum(raw)
        if bytes.fromhex(self.index_sum) != index_sum:
            raise LoadError(where, "the index's checksum does not match: the index is damaged", "index")
        self.size, self.data_end = size, index_offset
        try:
            self.index = json.loads(bytes(raw).decode("utf-8"))
            if not isinstance(self.index, dict) or self.index.get("format") != "ftw":
                raise ValueError('the index is not an FTW index (no "format": "ftw")')
            if self.index.get("version") != VERSION:
                raise ValueError(f"index version {self.index.get('version')!r}, preamble version {VERSION}")
        except ValueError as e:
            raise LoadError(where, f"malformed index: {e}", "index") from None

    def close(self) -> None:
        mm = getattr(self.map, "_mmap", None)
        self.map = None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views still alive: the mapping goes with the last of them
                pass


class FTWFile:
    """An FTW model, one file or a set of shards (docs/ftw.md), its index read and checked (not its data: that is
    checked as it is read). ``path``: the file, any shard of a set, or the name the set was written as
    (``model.ftw`` for ``model-00001-of-00003.ftw`` ...). ``path`` becomes the file holding the model's config (a
    set's shard 1), ``index`` its index, and ``shards`` lists every file; ``tensors`` and ``records`` cover them
    all, each entry knowing its shard."""

    def __init__(self, path: str | Path, verify: str = "full"):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        from freetoken.loaders.ftw_shards import open_parts

        self.verify = verify
        self._parts: list[FilePart] = open_parts(Path(path))
        first = self._parts[0]
        self.path, self.index = first.path, first.index
        self.shards = [p.path for p in self._parts]
        self.tensors: dict[str, TensorEntry] = {}
        self.records: dict[tuple[int, int], RecordEntry] = {}
        for i, part in enumerate(self._parts):
            try:
                if i == 0:
                    self._read_model(part.index)
                entries = self._read_tables(part, i)
            except LoadError:
                raise
            except (ValueError, KeyError, TypeError) as e:
                raise LoadError(str(part.path), f"malformed index: {e}", "index") from None
            self._check_layout(part, entries)

    # ---- the index ---------------------------------------------------------------------------------------
    def _read_model(self, ix: dict) -> None:
        """The model's side of the index (a set's shard 1 only): config, record layout, tokenizer side."""
        for k in ("model_config", "tensors", "records", "record_layout"):
            if k not in ix:
                raise KeyError(f"missing {k!r}")
        from freetoken.device.constants import ACTIVATIONS

        lay = ix["record_layout"]
        self.hidden, self.inter = _int(lay["hidden"], "hidden", 1), _int(lay["inter"], "inter", 1)
        self.bias, self.act = lay["bias"], lay["act"]
        if not isinstance(self.bias, bool) or self.act not in ACTIVATIONS:
            raise ValueError(f"record_layout: bias must be true or false and act one of {', '.join(ACTIVATIONS)}")
        for name, value in (("tokenizer", ix.get("tokenizer")), ("source", ix.get("source"))):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string or null")
        eos = ix.get("eos_ids") or []
        if not isinstance(eos, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in eos):
            raise ValueError("eos_ids must be a list of token ids")
        tpl = ix.get("chat_template")
        if tpl is not None and not (isinstance(tpl, dict) and isinstance(tpl.get("source"), str) and tpl["source"]
                                    and isinstance(tpl.get("special_tokens") or {}, dict)):
            raise ValueError("chat_template must be null or {source: non-empty text, special_tokens: {...}}")

    def _read_tables(self, part: FilePart, shard: int) -> list[TensorEntry | RecordEntry]:
        """The tensors and records ``part`` holds, added to the model's tables (and returned); an entry another
        shard already holds is refused (each tensor and record lives in exactly one file)."""
        ix = part.index
        entries: list[TensorEntry | RecordEntry] = []
        for k in ("tensors", "records"):
            if not isinstance(ix.get(k), list):
                raise ValueError(f"{k!r} missing or not a list")
        names: set[str] = set()
        for i, t in enumerate(ix["tensors"]):
            what = f"tensors[{i}]"
            name = t["name"]
            if not isinstance(name, str) or name in names:
                raise ValueError(f"{what}: name {name!r} missing or repeated")
            names.add(name)
            shape = tuple(_int(d, f"{name}: shape", 1) for d in t["shape"])
            if not isinstance(t["storage"], str):
                raise ValueError(f"{name}: storage must be a string")
            self._no_other_copy(self.tensors.get(name), part, f"tensor {name}", name)
            self.tensors[name] = TensorEntry(name, t["storage"], shape, _int(t["offset"], f"{name}: offset"),
                                             _int(t["bytes"], f"{name}: bytes"), _hex128(t["xxh3"], f"{name}: xxh3"),
                                             shard)
            entries.append(self.tensors[name])
        keys: set[tuple[int, int]] = set()
        for i, r in enumerate(ix["records"]):
            key = (_int(r["layer"], f"records[{i}].layer"), _int(r["expert"], f"records[{i}].expert"))
            if key in keys:
                raise ValueError(f"records[{i}]: a second record for layer {key[0]}, expert {key[1]}")
            keys.add(key)
            for f in (r["format"], r["down_format"]):
                if f not in FORMAT_CODES:
                    raise ValueError(f"records[{i}]: unknown expert format {f!r}")
            entry = RecordEntry(*key, r["format"], r["down_format"], _int(r["offset"], "offset"),
                                _int(r["bytes"], "bytes"), _hex128(r["xxh3"], f"records[{i}].xxh3"), shard)
            self._no_other_copy(self.records.get(key), part, entry.what, entry.what)
            self.records[key] = entry
            entries.append(entry)
        return entries

    def _no_other_copy(self, other, part: FilePart, what: str, name: str) -> None:
        if other is not None:
            raise LoadError(str(part.path), f"{what} is in this shard and in {self.shards[other.shard].name}: "
                                            "each lives in one shard", name)

    def _check_layout(self, part: FilePart, entries: list[TensorEntry | RecordEntry]) -> None:
        """Sizes against shapes and formats, every entry of ``part`` aligned and inside its data area, none
        overlapping (so no tensor or record runs on into another file)."""
        where = str(part.path)
        spans = []
        for t in entries:
            if isinstance(t, RecordEntry):
                continue
            if t.storage in FLOAT_STORAGES:
                want = int(np.prod(t.shape)) * FLOAT_STORAGES[t.storage].itemsize
            else:
                want = _quantized_bytes(t, where)
            if t.nbytes != want:
                raise LoadError(where, f"tensor {t.name}: {t.nbytes} bytes, {t.storage} {list(t.shape)} takes {want}",
                                t.name)
            spans.append((t.offset, t.nbytes, f"tensor {t.name}"))
        for r in entries:
            if isinstance(r, TensorEntry):
                continue
            try:
                want = RECORD_HEADER_BYTES + self.layout_of(r).record_bytes
            except ValueError as e:  # the formats do not fit the record layout's shape
                raise LoadError(where, f"{r.what}: {e}", r.what) from None
            if r.nbytes != want:
                raise LoadError(where, f"{r.what}: {r.nbytes} bytes, its formats take {want}", r.what)
            spans.append((r.offset, r.nbytes, r.what))
        end = ALIGN
        for offset, nbytes, what in sorted(spans):
            if offset % ALIGN:
                raise LoadError(where, f"{what} starts at {offset}, not on a {ALIGN}-byte boundary", what)
            if offset < end:
                raise LoadError(where, f"{what} (at {offset}) overlaps the preamble or the entry before it", what)
            if offset + nbytes > part.data_end:
                raise LoadError(where, f"{what} ({nbytes} bytes at {offset}) runs past the data (the index is at "
                                       f"{part.data_end})", what)
            end = offset + nbytes

    def file_of(self, entry: TensorEntry | RecordEntry) -> Path:
        """The file (shard) holding a tensor or record."""
        return self._parts[entry.shard].path

    def check_experts(self, moe_layers: list[int], num_experts: int) -> None:
        """Every MoE layer has exactly ``num_experts`` records and no other layer has any."""
        where = str(self.path)
        have: dict[int, set[int]] = {}
        for layer, expert in self.records:
            have.setdefault(layer, set()).add(expert)
        for layer in moe_layers:
            got = have.pop(layer, set())
            if got != set(range(num_experts)):
                missing = sorted(set(range(num_experts)) - got)[:5]
                extra = sorted(got - set(range(num_experts)))[:5]
                raise LoadError(where, f"MoE layer {layer} has {len(got)} expert records for {num_experts} experts "
                                       f"(missing {missing}, unexpected {extra})", f"layer {layer}")
        if have:
            raise LoadError(where, f"expert records for layers that are not MoE layers: {sorted(have)}")

    # ---- data --------------------------------------------------------------------------------------------
    def _checked(self, part: FilePart, offset: int, nbytes: int, want: str, what: str,
                 header: bytes = b"") -> np.ndarray:
        data = part.map[offset:offset + nbytes]
        if checksum(header, data) != want:
            raise LoadError(str(part.path), f"{what}: checksum mismatch (the file is damaged)", what)
        return data

    def tensor_bytes(self, name: str) -> np.ndarray:
        """A tensor's stored bytes (uint8, a read-only view of its file), checksum verified unless verify="none"."""
        t = self.tensors[name]
        part = self._parts[t.shard]
        if self.verify == "none":
            return part.map[t.offset:t.offset + t.nbytes]
        return self._checked(part, t.offset, t.nbytes, t.xxh3, f"tensor {name}")

    def layout_of(self, r: RecordEntry):
        from freetoken import formats
        from freetoken.formats import RecordLayout

        return RecordLayout(formats.get(r.fmt), self.hidden, self.inter, self.bias, self.act,
                            down_fmt=formats.get(r.down_fmt))

    def record_payload(self, layer: int, expert: int) -> np.ndarray:
        """An expert's banks as stored (uint8 view of its file, ``layout_of(record).record_bytes`` long), its header
        checked against the index and its checksum verified as ``verify`` says."""
        r = self.records[(layer, expert)]
        part = self._parts[r.shard]
        where = str(part.path)
        head = bytes(part.map[r.offset:r.offset + RECORD_HEADER_BYTES])
        want = record_header(r.fmt, r.down_fmt, self.bias, layer, expert, r.nbytes - RECORD_HEADER_BYTES)
        if head[:_CHECKSUM_AT] != want:
            raise LoadError(where, f"{r.what}: its header does not match the index (damaged or misplaced)", r.what)
        if head[_CHECKSUM_AT:] != bytes.fromhex(r.xxh3):
            raise LoadError(where, f"{r.what}: the checksum in its header differs from the index's", r.what)
        lo, hi = r.offset + RECORD_HEADER_BYTES, r.offset + r.nbytes
        sampled = (layer * 1_000_003 + expert) % SAMPLE_EVERY == 0
        if self.verify == "full" or (self.verify == "sample" and sampled):
            return self._checked(part, lo, hi - lo, r.xxh3, r.what, header=head[:_CHECKSUM_AT])
        return part.map[lo:hi]

    def record_banks(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """One expert's banks by name (views of the file), as ``RecordLayout.bank_specs`` lays them out."""
        from freetoken.formats.base import ALIGNMENT

        payload = self.record_payload(layer, expert)
        out, at = {}, 0
        for s in self.layout_of(self.records[(layer, expert)]).bank_specs():
            n = int(np.prod(s.shape, dtype=np.int64)) * s.dtype.itemsize
            out[s.name] = payload[at:at + n].view(s.dtype).reshape(s.shape)
            at += -(-n // ALIGNMENT) * ALIGNMENT
        return out

    def close(self) -> None:
        for part in self._parts:
            part.close()


def _quantized_bytes(t: TensorEntry, where: str) -> int:
    """Stored bytes of a block-quantized [N, K] tensor, or a LoadError for an unknown kind or a bad shape."""
    from freetoken.ops.dense import BLOCK_STORAGES, k_multiple, row_bytes

    if t.storage not in BLOCK_STORAGES:
        raise LoadError(where, f"tensor {t.name}: unknown storage {t.storage!r}", t.name)
    if len(t.shape) != 2 or t.shape[1] % k_multiple(t.storage):
        raise LoadError(where, f"tensor {t.name}: {t.storage} needs [N, K] with K a multiple of "
                               f"{k_multiple(t.storage)}, got {list(t.shape)}", t.name)
    return t.shape[0] * row_bytes(t.storage, t.shape[1])


def write_preamble(f, index_offset: int, index_bytes: int, index_sum: str, file_bytes: int) -> None:
    f.seek(0)
    f.write(PREAMBLE.pack(MAGIC, VERSION, index_offset, index_bytes, bytes.fromhex(index_sum), file_bytes, ALIGN))


def is_ftw(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the FTW magic (a whole model or any shard of a set), or names a
    sharded set by the name it was written as (``model.ftw`` for ``model-00001-of-00003.ftw`` ...)."""
    from freetoken.loaders.ftw_shards import first_shards

    p = Path(path)
    if not p.is_file():
        if p.exists():
            return False
        found = first_shards(p)
        if not found:
            return False
        p = found[0]
    try:
        with open(p, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False
