"""GGUF files (llama.cpp): metadata, tensors in NumPy order, Q4_0 / MXFP4 expert banks, the embedded tokenizer.

Wraps ``gguf.GGUFReader`` (which memory-maps the file). GGUF lists a tensor's dimensions in ggml order
(``ne[0]`` = the contiguous row length); everything here uses NumPy order, the reverse: ggml ne = [D, F, E] is
NumPy [E, F, D]. Reads past the end of the file are caught while the header is parsed, so a truncated file fails
at open with a :class:`LoadError` naming the file (and the first tensor whose data is cut off).
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize

from freetoken.formats import MATRICES
from freetoken.formats.table import GGML_EXPERT_FORMATS
from freetoken.loaders.errors import LoadError

#: Every architecture name gguf-py knows ("llama", "qwen3moe", "deepseek2", "gpt-oss", ...).
KNOWN_ARCHS = frozenset(MODEL_ARCH_NAMES.values())

_T = GGMLQuantizationType
#: Plain (unblocked) ggml types and their NumPy dtypes.
PLAIN_TYPES: dict[GGMLQuantizationType, np.dtype] = {
    _T.F32: np.dtype("<f4"), _T.F16: np.dtype("<f2"), _T.BF16: np.dtype(ml_dtypes.bfloat16),
    _T.F64: np.dtype("<f8"), _T.I8: np.dtype(np.int8), _T.I16: np.dtype("<i2"), _T.I32: np.dtype("<i4"),
    _T.I64: np.dtype("<i8"),
}
#: ggml types of expert tensors that :meth:`GGUFFile.expert_banks` converts, and the format they become.
EXPERT_FORMATS = {_T[ggml]: name for ggml, name in GGML_EXPERT_FORMATS.items()}

#: Fixed 4-byte magic, 4-byte version, 8-byte tensor count, 8-byte kv count.
_MIN_HEADER = 24


class GGUFTensorInfo(NamedTuple):
    """What :meth:`GGUFFile.info` returns: the ggml type name and the NumPy-order element shape."""

    type: str
    shape: tuple[int, ...]


class _Truncated(Exception):
    def __init__(self, offset: int, size: int):
        super().__init__(f"a read at byte {offset} runs past the end of the file ({size} bytes)")


class _Reader(GGUFReader):
    """GGUFReader with bounds-checked reads: gguf-py slices its memmap, which silently yields short arrays past
    the end of a truncated file (and can then loop over a corrupt array length)."""

    def _get(self, offset, dtype, count=1, *args, **kwargs):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _Truncated(int(offset), len(self.data))
        return super()._get(offset, dtype, count, *args, **kwargs)

    def _build_tensors(self, start_offs, fields):
        # Name the first tensor whose data is cut off. Reads gguf-py's tensor-info parts
        # (name_len, name, n_dims, dims, type, offset); the base class re-validates everything anyway.
        for f in fields:
            try:
                name = bytes(f.parts[1]).decode("utf-8", "replace")
                ne = [int(d) for d in f.parts[3]]
                t = GGMLQuantizationType(int(f.parts[4][0]))
                block, size = GGML_QUANT_SIZES[t]
                end = int(start_offs) + int(f.parts[5][0]) + math.prod(ne) * size // block
            except Exception:  # unknown type, or a gguf-py layout change: the base class reports it
                continue
            if end > len(self.data):
                raise LoadError(self._path, f"truncated: data ends at byte {end} but the file has {len(self.data)} "
                                            "bytes", name)
        super()._build_tensors(start_offs, fields)

    def _get_field_parts(self, orig_offs, raw_type):
        # gguf-py parses an array element by element (a NumPy view and list entries per item): a numeric array of
        # millions of items, legal or a corrupt length, takes minutes and gigabytes. One view for the whole array.
        if raw_type == GGUFValueType.ARRAY:
            itype = self._get(orig_offs, np.uint32)
            nptype = self.gguf_scalar_to_np.get(GGUFValueType(int(itype[0])))
            alen = self._get(orig_offs + 4, np.uint64)
            n = int(alen[0])
            types = [GGUFValueType.ARRAY] + ([GGUFValueType(int(itype[0]))] if n else [])
            if nptype is not None:
                items = self._get(orig_offs + 12, nptype, n)
                return 12 + int(items.nbytes), [itype, alen, items], [2] if n else [], types
            if int(itype[0]) == GGUFValueType.STRING and self.byte_order == "I":
                return self._string_array(orig_offs, itype, alen, n, types)
        return super()._get_field_parts(orig_offs, raw_type)

    def _string_array(self, orig_offs, itype, alen, n, types):
        """A string array as gguf-py lays it out (a length part and a bytes part per item), read through a plain
        ndarray view: memmap slicing costs ~10 us per part, minutes for a large vocabulary."""
        buf = self.data.view(np.ndarray)
        raw = memoryview(buf)
        size = len(buf)
        off = orig_offs + 12
        parts: list = [itype, alen]
        idxs: list[int] = []
        for _ in range(n):  # n <= remaining bytes / 8 (checked by _Scan before gguf-py runs)
            if off + 8 > size:
                raise _Truncated(off, size)
            ln = int.from_bytes(raw[off:off + 8], "little")
            if off + 8 + ln > size:
                raise _Truncated(off + 8, size)
            parts.append(buf[off:off + 8].view(np.uint64))
            parts.append(buf[off + 8:off + 8 + ln])
            idxs.append(len(parts) - 1)
            off += 8 + ln
        return off - orig_offs, parts, idxs, types

    def __init__(self, path):
        self._path = os.fspath(path)
        super().__init__(path, "r")


# ---- the header, walked before gguf-py parses it -----------------------------------------------------------

#: GGUF value types -> fixed sizes in bytes (STRING = 8, ARRAY = 9 are variable).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
#: ggml's GGML_MAX_DIMS.
MAX_TENSOR_DIMS = 4
#: A metadata key or tensor name longer than this is corrupt (llama.cpp caps names at 64 bytes; keys are short).
MAX_NAME_BYTES = 1 << 16
#: Arrays nest at most this deep (llama.cpp reads no nested arrays at all; gguf-py writes one level).
MAX_ARRAY_NESTING = 2
#: Items of one string array (gguf-py parses them one by one): the largest vocabularies and merge lists hold well
#: under a million.
MAX_STRING_ITEMS = 1 << 23
#: ``general.alignment`` above this is corrupt (llama.cpp writes 32; any power of two is legal).
MAX_ALIGNMENT = 1 << 24


class _Scan:
    """Walks a GGUF header with every length, count and offset bounded by the bytes that remain, so that no
    value in the file can make the walk (or gguf-py's parse after it) allocate or loop beyond the file's size.
    Raises LoadError naming the file and, where one is involved, the key or tensor."""

    def __init__(self, path: Path, buf):
        self.path, self.buf, self.size = path, buf, len(buf)

    def fail(self, msg: str, tensor: str | None = None):
        raise LoadError(self.path, msg, tensor)

    def u(self, off: int, n: int, what: str) -> int:
        if off + n > self.size:
            self.fail(f"truncated or corrupt header: {what} at byte {off} runs past the end of the file "
                      f"({self.size} bytes)")
        return int.from_bytes(self.buf[off:off + n], "little")

    def string(self, off: int, what: str, limit: int | None = None) -> tuple[int, bytes]:
        n = self.u(off, 8, f"the length of {what}")
        if n > self.size - off - 8 or (limit is not None and n > limit):
            self.fail(f"corrupt header: {what} declares {n} bytes but only {self.size - off - 8} remain"
                      if n > self.size - off - 8 else f"corrupt header: {what} is {n} bytes long (limit {limit})")
        return off + 8 + n, bytes(self.buf[off + 8:off + 8 + n])

    def value(self, off: int, vtype: int, key: str, depth: int = 0) -> int:
        """Offset just past one value of ``vtype``."""
        if vtype in _SCALAR_SIZES:
            self.u(off, _SCALAR_SIZES[vtype], f"the value of {key!r}")  # in bounds
            return off + _SCALAR_SIZES[vtype]
        if vtype == _STRING:
            return self.string(off, f"the value of {key!r}")[0]
        if vtype != _ARRAY:
            self.fail(f"corrupt header: metadata key {key!r} has unknown value type {vtype}")
        if depth >= MAX_ARRAY_NESTING:
            self.fail(f"corrupt header: metadata key {key!r} nests arrays more than {MAX_ARRAY_NESTING} deep")
        item = self.u(off, 4, f"the item type of {key!r}")
        count = self.u(off + 4, 8, f"the length of {key!r}")
        off += 12
        remaining = self.size - off
        least = _SCALAR_SIZES.get(item, 8 if item == _STRING else 12)
        if item not in _SCALAR_SIZES and item not in (_STRING, _ARRAY):
            self.fail(f"corrupt header: metadata array {key!r} has unknown item type {item}")
        if count * least > remaining:
            self.fail(f"corrupt header: metadata array {key!r} declares {count} items of at least {least} bytes "
                      f"but only {remaining} bytes remain")
        if item in _SCALAR_SIZES:
            return off + count * least
        if count > MAX_STRING_ITEMS:
            self.fail(f"corrupt header: metadata array {key!r} declares {count} items (the limit for arrays of "
                      f"strings or arrays is {MAX_STRING_ITEMS})")
        for _ in range(count):  # count <= remaining / 8: bounded by the file's size
            off = self.value(off, item, key, depth + 1)
        return off

    def walk(self) -> dict:
        """{"alignment", "data_offset", "tensors": [(name, dims, type, offset, nbytes)]} of the header."""
        version = self.u(4, 4, "the version")
        if version not in (2, 3):
            self.fail(f"unsupported GGUF version {version} (gguf-py reads versions 2 and 3)"
                      if version & 0xFFFF else "big-endian GGUF files are not supported")
        n_tensors, n_kv = self.u(8, 8, "the tensor count"), self.u(16, 8, "the metadata count")
        off = 24
        if n_kv * 13 > self.size - off:  # a key length (8), type (4) and at least one byte of value each
            self.fail(f"corrupt header: {n_kv} metadata entries declared, the file has room for at most "
                      f"{(self.size - off) // 13}")
        if n_tensors * 24 > self.size - off:  # name length, dims count, type and offset at least
            self.fail(f"corrupt header: {n_tensors} tensors declared, the file has room for at most "
                      f"{(self.size - off) // 24}")
        alignment = 32
        for i in range(n_kv):
            off, raw = self.string(off, f"metadata key #{i}", MAX_NAME_BYTES)
            key = raw.decode("utf-8", "replace")
            vtype = self.u(off, 4, f"the type of {key!r}")
            if key == "general.alignment":
                if vtype != 4:
                    self.fail(f"corrupt header: general.alignment has value type {vtype}, expected uint32")
                alignment = self.u(off + 4, 4, "general.alignment")
                if not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
                    self.fail(f"corrupt header: general.alignment {alignment} is not a power of two in "
                              f"[1, {MAX_ALIGNMENT}]")
            off = self.value(off + 4, vtype, key)
        tensors = []
        for i in range(n_tensors):
            off, raw = self.string(off, f"the name of tensor #{i}", MAX_NAME_BYTES)
            name = raw.decode("utf-8", "replace")
            n_dims = self.u(off, 4, f"the dimension count of {name!r}")
            if not 1 <= n_dims <= MAX_TENSOR_DIMS:
                self.fail(f"corrupt header: {n_dims} dimensions (ggml has 1 to {MAX_TENSOR_DIMS})", name)
            dims = [self.u(off + 4 + 8 * j, 8, f"the dimensions of {name!r}") for j in range(n_dims)]
            off += 4 + 8 * n_dims
            ttype, offset = self.u(off, 4, f"the type of {name!r}"), self.u(off + 4, 8, f"the offset of {name!r}")
            off += 12
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                self.fail(f"corrupt header: unknown ggml type {ttype}", name)
            if any(d < 1 or d > self.size * block for d in dims):
                self.fail(f"corrupt header: dimensions {dims} (ggml order) are not all in [1, {self.size * block}]",
                          name)
            if dims[0] % block:
                self.fail(f"corrupt header: rows of {dims[0]} {GGMLQuantizationType(ttype).name} values are not "
                          f"whole blocks of {block}", name)
            tensors.append((name, dims, ttype, offset, math.prod(dims) // block * size))
        data = -(-off // alignment) * alignment
        seen: set[str] = set()
        for name, _, _, offset, nbytes in tensors:
            if name in seen:
                self.fail("corrupt header: a second tensor with this name", name)
            seen.add(name)
            if offset % alignment:
                self.fail(f"corrupt header: data offset {offset} is not a multiple of the alignment {alignment}",
                          name)
            if data + offset + nbytes > self.size:
                self.fail(f"truncated: data ends at byte {data + offset + nbytes} but the file has {self.size} "
                          "bytes", name)
        spans = sorted((offset, offset + nbytes, name) for name, _, _, offset, nbytes in tensors if nbytes)
        for (_, end0, name0), (start1, _, name1) in zip(spans, spans[1:], strict=False):
            if start1 < end0:
                self.fail(f"corrupt header: data overlaps that of {name0!r}", name1)
        return {"alignment": alignment, "data_offset": data, "tensors": tensors}


def _decode(b: np.ndarray) -> str:
    return bytes(b).decode("utf-8", "surrogateescape")


def field_value(field) -> Any:
    """Decode a ``gguf.ReaderField``: str, Python scalar, list of str, or a 1-D NumPy array for numeric arrays.

    gguf-py keeps every component of a field in ``parts`` (key length, key, type, then the value's pieces:
    length + bytes for a string, type + count + items for an array) and ``data`` lists the ``parts`` indices
    that hold the value. Nested arrays come back flattened (gguf-py flattens them).
    """
    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.STRING:
        return _decode(field.parts[field.data[0]])
    if types[0] == GGUFValueType.ARRAY:
        sub = types[-1]
        if sub == GGUFValueType.STRING:
            return [_decode(field.parts[i]) for i in field.data]
        if not field.data:
            return np.zeros(0, GGUFReader.gguf_scalar_to_np.get(sub, np.uint8))
        items = [field.parts[i] for i in field.data]
        return np.concatenate(items).astype(items[0].dtype.newbyteorder("="))
    return field.parts[field.data[0]][0].item()


_MISSING = object()


class GGUFFile:
    """One GGUF file. ``archs``: if given, the architectures the caller accepts (LoadError for others)."""

    def __init__(self, path: str | os.PathLike, archs: tuple[str, ...] | None = None):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except FileNotFoundError:
            raise LoadError(self.path, "missing") from None
        except OSError as e:
            raise LoadError(self.path, f"cannot read: {e}") from e
        if size < _MIN_HEADER:
            raise LoadError(self.path, f"truncated: {size} bytes, too short for a GGUF header")
        if magic != b"GGUF":
            raise LoadError(self.path, f"not a GGUF file (magic {magic!r})")
        try:
            buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise LoadError(self.path, f"cannot map: {e}") from e
        #: the header as walked before gguf-py parses it (every length bounded by the file's size)
        self.layout = _Scan(self.path, memoryview(buf)).walk()
        del buf
        try:
            self._reader = _Reader(self.path)
        except LoadError:
            raise
        except _Truncated as e:
            raise LoadError(self.path, f"truncated or corrupt header: {e}") from e
        except Exception as e:  # gguf-py raises ValueError, KeyError, IndexError... for corrupt headers
            raise LoadError(self.path, f"corrupt GGUF header ({type(e).__name__}: {e})") from e
        if self._reader.byte_order != "I":
            raise LoadError(self.path, "big-endian GGUF files are not supported")
        self._tensors = {t.name: t for t in self._reader.tensors}
        arch = self.meta("general.architecture", None)
        if not isinstance(arch, str):
            raise LoadError(self.path, "no general.architecture key")
        if arch not in KNOWN_ARCHS:
            raise LoadError(self.path, f"unknown architecture {arch!r}")
        if archs is not None and arch not in archs:
            raise LoadError(self.path, f"architecture {arch!r} is not supported here (supported: {', '.join(archs)})")
        self.arch: str = arch

    def __repr__(self) -> str:
        return f"<GGUFFile {str(self.path)!r}: {self.arch}, {len(self._tensors)} tensors>"

    # ---- metadata --------------------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Every metadata key (without gguf-py's synthetic ``GGUF.*`` entries)."""
        return [k for k in self._reader.fields if not k.startswith("GGUF.")]

    def _field(self, key: str):
        f = self._reader.fields.get(key)
        if f is None and not key.startswith(("general.", "tokenizer.")) and hasattr(self, "arch"):
            f = self._reader.fields.get(f"{self.arch}.{key}")
        return f

    def has_meta(self, key: str) -> bool:
        return self._field(key.replace("{arch}", getattr(self, "arch", "{arch}"))) is not None

    def meta(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value: ``"general.name"``, ``"qwen3moe.expert_count"``, ``"{arch}.expert_count"`` or just
        ``"expert_count"`` (tried as ``{arch}.expert_count`` when no such key exists). Strings come back as str,
        scalars as Python numbers, string arrays as lists, numeric arrays as 1-D NumPy arrays. Without a
        ``default``, a missing key is a LoadError."""
        key = key.replace("{arch}", getattr(self, "arch", "{arch}"))
        f = self._field(key)
        if f is None:
            if default is _MISSING:
                raise LoadError(self.path, f"no metadata key {key!r}")
            return default
        try:
            return field_value(f)
        except Exception as e:
            raise LoadError(self.path, f"cannot decode metadata key {key!r}: {e}") from e

    # ---- tensors ---------------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    __contains__ = has

    def __len__(self) -> int:
        return len(self._tensors)

    def _tensor(self, name: str):
        t = self._tensors.get(name)
        if t is None:
            close = difflib.get_close_matches(name, self._tensors, n=3)
            hint = f"; similar: {close}" if close else ""
            raise LoadError(self.path, f"missing from the file ({len(self._tensors)} tensors){hint}", name)
        return t

    @staticmethod
    def _np_shape(t) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(t.shape.tolist()))

    def info(self, name: str) -> GGUFTensorInfo:
        """(ggml type name, NumPy-order element shape)."""
        t = self._tensor(name)
        return GGUFTensorInfo(GGMLQuantizationType(t.tensor_type).name, self._np_shape(t))

    def tensor_nbytes(self, name: str) -> int:
        """Bytes ``name``'s data takes in the file."""
        t = self._tensor(name)
        return int(t.n_bytes)

    def get_raw(self, name: str) -> tuple[np.ndarray, GGMLQuantizationType, tuple[int, ...]]:
        """(zero-copy uint8 bytes [..., bytes per row], ggml type, NumPy-order element shape)."""
        t = self._tensor(name)
        shape = self._np_shape(t)
        gt = GGMLQuantizationType(t.tensor_type)
        block, size = GGML_QUANT_SIZES[gt]
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        return raw.reshape(*shape[:-1], shape[-1] // block * size), gt, shape

    def get(self, name: str) -> np.ndarray:
        """``name`` in NumPy order: plain types (F32, F16, BF16 as ``ml_dtypes.bfloat16``, F64, I8..I64) as
        zero-copy read-only views; block-quantized types dequantized to float32 (see :meth:`get_raw`)."""
        raw, t, shape = self.get_raw(name)
        dt = PLAIN_TYPES.get(t)
        if dt is None:
            return self._dequantize(name, raw, t, shape)
        return raw.view(dt).reshape(shape)

    def get_f32(self, name: str) -> np.ndarray:
        """``name`` as a new float32 array in NumPy order (quantized types via ``gguf.quants.dequantize``)."""
        raw, t, shape = self.get_raw(name)
        if t in PLAIN_TYPES:
            return np.array(raw.view(PLAIN_TYPES[t]).reshape(shape), dtype=np.float32)
        return self._dequantize(name, raw, t, shape)

    def _dequantize(self, name, raw, t, shape) -> np.ndarray:
        try:
            out = gguf_dequantize(raw, t)
        except NotImplementedError as e:
            raise LoadError(self.path, f"gguf-py cannot dequantize {t.name}", name) from e
        return np.asarray(out, dtype=np.float32).reshape(shape)

    # ---- experts ---------------------------------------------------------------------------------------------

    def expert_names(self, layer: int) -> dict[str, str]:
        """{"gate": "blk.N.ffn_gate_exps.weight", "up": ..., "down": ...}."""
        return {m: f"blk.{layer}.ffn_{m}_exps.weight" for m in MATRICES}

    def expert_formats(self, layer: int) -> tuple[str, str]:
        """The :mod:`freetoken.formats` names :meth:`expert_banks` produces for ``layer``: (gate/up, down). They may
        differ (llama.cpp's Q4_K_M keeps ``ffn_down_exps`` in Q6_K in some layers); gate and up must agree."""
        types = {}
        for m, name in self.expert_names(layer).items():
            t = types[m] = self._tensor(name).tensor_type
            if t not in EXPERT_FORMATS:
                raise LoadError(self.path, f"expert tensor is {GGMLQuantizationType(t).name}; expert banks are "
                                           f"made from {'/'.join(x.name for x in EXPERT_FORMATS)} only", name)
        if types["gate"] != types["up"]:
            got = ", ".join(f"{m} {GGMLQuantizationType(t).name}" for m, t in types.items())
            raise LoadError(self.path, f"layer {layer}: gate and up expert tensors differ in type ({got}); an expert "
                                       "record keeps gate and up in one format")
        return EXPERT_FORMATS[types["gate"]], EXPERT_FORMATS[types["down"]]

    def expert_format(self, layer: int) -> str:
        """The record's formats of ``layer`` as one name: "q4_0", or "q4_k+q6_k" when down differs from gate/up
        (:attr:`freetoken.formats.RecordLayout.name`)."""
        up, down = self.expert_formats(layer)
        return up if up == down else f"{up}+{down}"

    def expert_banks(self, layer: int) -> dict[str, np.ndarray]:
        """Routed experts of ``layer`` as record banks ``{"gate.w", "gate.s", "up.w", ..., "down.s"}`` (plus
        float32 ``"<m>.b"`` when the file has ``blk.N.ffn_<m>_exps.bias``), bytes moved only.

        gate and up are [E, F, D] (F = expert FFN width, D = embedding), down is [E, D, F], exactly the record
        layout's gate [I, H], up [I, H], down [H, I]. Each ggml type becomes the banks of its format in
        :data:`EXPERT_FORMATS` (Q4_0 -> ``q4_0``, Q4_K -> ``q4_k``, MXFP4 -> ``mxfp4``, ...), per matrix.
        """
        import importlib

        names = self.expert_names(layer)
        up_fmt, down_fmt = self.expert_formats(layer)
        fmts = {"gate": up_fmt, "up": up_fmt, "down": down_fmt}
        shapes = {m: self._np_shape(self._tensors[n]) for m, n in names.items()}
        gate = shapes["gate"]
        if len(gate) != 3:
            raise LoadError(self.path, f"expected [E, F, D] expert tensor, got shape {list(gate)}", names["gate"])
        e, f, d = gate
        want = {"gate": (e, f, d), "up": (e, f, d), "down": (e, d, f)}
        for m in MATRICES:
            if shapes[m] != want[m]:
                raise LoadError(self.path, f"expected shape {list(want[m])} (gate is {list(gate)}), got "
                                           f"{list(shapes[m])}", names[m])
        out: dict[str, np.ndarray] = {}
        for m in MATRICES:
            raw, _, _ = self.get_raw(names[m])
            try:
                banks = importlib.import_module(f"freetoken.formats.{fmts[m]}").from_gguf(raw)
            except ValueError as err:
                raise LoadError(self.path, f"cannot convert to {fmts[m]} banks: {err}", names[m]) from err
            out.update({f"{m}.{k}": v for k, v in banks.items()})
            bias = names[m].removesuffix(".weight") + ".bias"
            if bias in self._tensors:
                b = self.get_f32(bias)
                if b.shape != (e, want[m][1]):
                    raise LoadError(self.path, f"expected shape {[e, want[m][1]]}, got {list(b.shape)}", bias)
                out[f"{m}.b"] = b
        return out

    # ---- tokenizer -------------------------------------------------------------------------------------------

    def tokenizer_meta(self) -> dict[str, Any]:
        """The embedded vocabulary: ``model`` (``tokenizer.ggml.model``: "gpt2", "llama", ...), ``pre``,
        ``tokens`` (list of str), ``token_types`` (int32 array or None), ``scores`` (float32 array or None),
        ``merges`` (list of "a b" strings or None), special ids (``bos_token_id``, ``eos_token_id``,
        ``eot_token_id``, ``unknown_token_id``, ``padding_token_id``, ... or None), ``add_bos_token``,
        ``add_eos_token``, ``add_space_prefix`` (SentencePiece vocabularies; bool or None), ``chat_template``
        (str or None) and ``chat_templates`` (named extra
        templates, {} if none)."""
        tk = "tokenizer.ggml."
        model = self.meta(tk + "model", None)
        if model is None:
            raise LoadError(self.path, "no embedded tokenizer (tokenizer.ggml.model missing)")
        tokens = self.meta(tk + "tokens", None)
        if not isinstance(tokens, list) or not tokens:
            raise LoadError(self.path, "embedded tokenizer without tokenizer.ggml.tokens")
        out: dict[str, Any] = {"model": model, "pre": self.meta(tk + "pre", None), "tokens": tokens}
        for key, dtype in (("token_type", np.int32), ("scores", np.float32)):
            v = self.meta(tk + key, None)
            if v is not None:
                v = np.asarray(v, dtype=dtype)
                if v.shape != (len(tokens),):
                    raise LoadError(self.path, f"tokenizer.ggml.{key} has {v.size} entries for {len(tokens)} tokens")
            out["token_types" if key == "token_type" else key] = v
        out["merges"] = self.meta(tk + "merges", None)
        for key in ("bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask"):
            v = self.meta(f"{tk}{key}_token_id", None)
            if v is not None and not 0 <= int(v) < len(tokens):
                raise LoadError(self.path, f"tokenizer.ggml.{key}_token_id {v} is outside the {len(tokens)}-token "
                                           "vocabulary")
            out[f"{key}_token_id"] = None if v is None else int(v)
        for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
            v = self.meta(tk + key, None)
            out[key] = None if v is None else bool(v)
        out["chat_template"] = self.meta("tokenizer.chat_template", None)
        names = self.meta("tokenizer.chat_templates", None) or []
        out["chat_templates"] = {n: self.meta(f"tokenizer.chat_template.{n}", None) for n in names}
        return out
