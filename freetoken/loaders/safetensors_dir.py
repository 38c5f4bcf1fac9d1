"""Hugging Face model directories: ``config.json`` plus ``model.safetensors`` or an index and its shards.

Every shard header is parsed (8-byte little-endian length, JSON, raw bytes) and validated when the directory is
opened, so a truncated or corrupt file fails at once with a :class:`LoadError` naming it, before any long work.
Tensor data is never read eagerly: :meth:`SafetensorsDir.get` returns a zero-copy, read-only NumPy view of a
memory map of the shard. ``safetensors``' own NumPy loader is not used (it cannot map F8_E4M3 / F8_E8M0).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from freetoken.loaders.errors import LoadError

#: safetensors dtype strings -> NumPy dtypes (little-endian, as the format stores them).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}

#: safetensors refuses headers above 100 MB; so do we (a corrupt length would otherwise allocate it).
MAX_HEADER_BYTES = 100_000_000
#: A safetensors header is an object of objects holding lists of numbers: depth 3 (4 with ``__metadata__``'s
#: values, which must be strings anyway). Anything nested deeper is refused before ``json.loads`` recurses.
MAX_HEADER_DEPTH = 8
#: Dimensions of one tensor (safetensors itself has no limit; no real checkpoint comes near it).
MAX_DIMS = 16
#: Tensors in one file: a real shard holds at most a few thousand; every entry costs bytes of the header anyway.
MAX_TENSORS = 1_000_000

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
HF_QUANT_CONFIG = "hf_quant_config.json"


class TensorInfo(NamedTuple):
    """What :meth:`SafetensorsDir.info` returns: safetensors dtype string, shape, and the file holding it."""

    dtype: str
    shape: tuple[int, ...]
    file: str


@dataclass
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


@dataclass
class _Shard:
    path: Path
    size: int
    entries: dict[str, _Entry]
    metadata: dict[str, str] | None
    mm: np.ndarray | None = field(default=None, repr=False)

    def view(self, e: _Entry) -> np.ndarray:
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)
        return self.mm[e.start:e.end].view(DTYPES[e.dtype]).reshape(e.shape)


def _shape_str(shape: Iterable[Any]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def _short(x: Any) -> str:
    """repr(x) cut to 60 characters (a hostile header may hold megabyte lists or 4000-digit numbers)."""
    if _is_int(x) and abs(x) > 10**30:
        return f"a {'negative ' if x < 0 else ''}{len(str(abs(x))) if abs(x) < 10**4000 else 'huge'}-digit integer"
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


#: Small JSON files (config.json, the index, hf_quant_config.json) larger than this are refused unread.
MAX_JSON_BYTES = 64 << 20
#: Nesting deeper than this in such a file is refused before the parser recurses (RecursionError otherwise).
MAX_JSON_DEPTH = 64


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in JSON bytes (brackets inside strings are not counted); C-speed
    passes only, so a 100 MB header costs a fraction of a second."""
    brackets = _JSON_STRING.sub(b'""', raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    b = np.frombuffer(brackets, np.uint8)
    return int(np.cumsum(np.where((b == ord("[")) | (b == ord("{")), 1, -1), dtype=np.int64).max())


def loads_bounded(path, text: bytes, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` of ``text`` (from ``path``) with every parser failure as a LoadError: invalid UTF-8 or JSON,
    nesting deeper than ``max_depth``, integers of thousands of digits, NaN/Infinity (not JSON)."""
    try:
        doc = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LoadError(path, f"corrupt {what}: not UTF-8 ({e})") from e
    depth = json_depth(text)
    if depth > max_depth:
        raise LoadError(path, f"corrupt {what}: JSON nested {depth} deep (the limit is {max_depth})")

    def constant(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(doc, parse_constant=constant)
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        raise LoadError(path, f"corrupt {what}: {type(e).__name__}: {str(e)[:200]}") from None


def read_json(path: Path, what: str = "JSON file", why_needed: str | None = None) -> Any:
    """Parse a small JSON file; LoadError (naming it) when it is missing, unreadable, too large, too deeply
    nested or not valid JSON."""
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise LoadError(path, f"missing ({why_needed or what})") from None
    except OSError as e:
        raise LoadError(path, f"cannot read {what}: {e}") from e
    if len(text) > MAX_JSON_BYTES:
        raise LoadError(path, f"{what} is larger than the {MAX_JSON_BYTES >> 20} MiB limit")
    return loads_bounded(path, text, what)


def parse_header(path: str | os.PathLike) -> _Shard:
    """Read and validate one safetensors file's header (no tensor data is read)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LoadError(path, f"truncated: {size} bytes, too short for a safetensors header length")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise LoadError(path, f"corrupt header: declared length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
            if 8 + n > size:
                raise LoadError(path, f"truncated: header declares {n} bytes but only {size - 8} follow the length")
            raw = f.read(n)
    except FileNotFoundError:
        raise LoadError(path, "missing") from None
    except OSError as e:
        raise LoadError(path, f"cannot read: {e}") from e
    header = loads_bounded(path, raw, "header JSON", MAX_HEADER_DEPTH)
    if not isinstance(header, dict):
        raise LoadError(path, f"corrupt header: JSON {type(header).__name__}, expected an object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and (not isinstance(metadata, dict)
                                 or not all(isinstance(v, str) for v in metadata.values())):
        raise LoadError(path, "corrupt header: __metadata__ is not an object of strings")
    if len(header) > MAX_TENSORS:
        raise LoadError(path, f"corrupt header: {len(header)} tensors (the limit is {MAX_TENSORS})")
    base = 8 + n
    data_size = size - base
    entries: dict[str, _Entry] = {}
    for name, spec in header.items():
        if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= spec.keys():
            raise LoadError(path, "corrupt header entry: wants dtype, shape and data_offsets", name)
        dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise LoadError(path, f"unsupported dtype {_short(dtype)} (known: {', '.join(DTYPES)})", name)
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(_is_int(s) and 0 <= s <= data_size for s in shape)):
            raise LoadError(path, f"corrupt header: shape {_short(shape)} is not a list of at most {MAX_DIMS} "
                                  f"non-negative integers no larger than the data ({data_size} bytes)", name)
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise LoadError(path, f"corrupt header: data_offsets {_short(offsets)} are not [begin, end]", name)
        if offsets[1] > data_size:
            raise LoadError(path, f"truncated: data ends at byte {_short(base + offsets[1])} but the file has "
                                  f"{size} bytes", name)
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise LoadError(path, f"corrupt header: {dtype} {_shape_str(shape)} needs {_short(nbytes)} bytes, "
                                  f"data_offsets {offsets} span {offsets[1] - offsets[0]}", name)
        entries[name] = _Entry(dtype, tuple(shape), base + offsets[0], base + offsets[1])
    spans = sorted((e.start, e.end, k) for k, e in entries.items() if e.end > e.start)
    for (_, end0, name0), (start1, _, name1) in zip(spans, spans[1:], strict=False):
        if start1 < end0:
            raise LoadError(path, f"corrupt header: data of {name1!r} overlaps that of {name0!r}", name1)
    return _Shard(path, size, entries, metadata)


class SafetensorsDir:
    """A Hugging Face model directory, opened lazily (headers only) and validated up front.

    ``config`` is the parsed ``config.json``; ``hf_quant_config`` the parsed ``hf_quant_config.json`` (ModelOpt)
    or None. With an index, the index's ``weight_map`` is authoritative (as in ``transformers``): tensors a shard
    holds but the index does not list are not exposed.
    """

    def __init__(self, path: str | os.PathLike):
        if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
            raise LoadError(path, "safetensors views need a little-endian host")
        self.path = Path(path)
        if not self.path.is_dir():
            raise LoadError(self.path, "not a directory (an HF model directory holds config.json and safetensors)")
        config = read_json(self.path / CONFIG, "model config", "an HF model directory needs config.json")
        if not isinstance(config, dict):
            raise LoadError(self.path / CONFIG, f"corrupt config: JSON {type(config).__name__}, expected an object")
        self.config: dict[str, Any] = config
        hq = self.path / HF_QUANT_CONFIG
        self.hf_quant_config: dict[str, Any] | None = read_json(hq, "ModelOpt quantization config") \
            if hq.is_file() else None
        if self.hf_quant_config is not None and not isinstance(self.hf_quant_config, dict):
            raise LoadError(hq, f"corrupt: JSON {type(self.hf_quant_config).__name__}, expected an object")
        self._shards: dict[str, _Shard] = {}
        self._where: dict[str, str] = {}  # tensor name -> shard file name
        single, index = self.path / SINGLE, self.path / INDEX
        if single.is_file():
            self.index_file: Path | None = None
            self._shards[SINGLE] = parse_header(single)
            self._where = dict.fromkeys(self._shards[SINGLE].entries, SINGLE)
        elif index.is_file():
            self.index_file = index
            self._open_index(index)
        else:
            found = sorted(p.name for p in self.path.glob("*.safetensors"))
            raise LoadError(self.path, f"no {SINGLE} or {INDEX}" + (f" (found {found})" if found else ""))

    def _open_index(self, index: Path) -> None:
        doc = read_json(index, "safetensors index")
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise LoadError(index, "corrupt index: wants {\"weight_map\": {tensor name: shard file}}")
        by_shard: dict[str, list[str]] = {}
        for name, file in wm.items():
            by_shard.setdefault(file, []).append(name)
        for file, names in by_shard.items():
            p = Path(file)
            if p.is_absolute() or ".." in p.parts:
                raise LoadError(index, f"shard {file!r} is not a file inside the model directory")
            if not (self.path / p).is_file():
                raise LoadError(self.path / p, f"missing: {INDEX} lists it as the shard of {len(names)} tensors "
                                               f"(e.g. {names[0]!r})")
        for file in by_shard:  # every header, before any tensor check: a corrupt shard is reported as such
            self._shards[file] = parse_header(self.path / file)
        for file, names in by_shard.items():
            entries = self._shards[file].entries
            for name in names:
                if name not in entries:
                    raise LoadError(self._shards[file].path, f"listed in {INDEX} but missing from this shard", name)
        self._where = dict(wm)

    # ---- lookup ----------------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every tensor name, in index (or header) order."""
        return list(self._where)

    def files(self) -> list[Path]:
        """The safetensors files in use."""
        return [s.path for s in self._shards.values()]

    def has(self, name: str) -> bool:
        return name in self._where

    __contains__ = has

    def __len__(self) -> int:
        return len(self._where)

    def __repr__(self) -> str:
        return f"<SafetensorsDir {str(self.path)!r}: {len(self)} tensors in {len(self._shards)} files>"

    def _entry(self, name: str) -> tuple[_Shard, _Entry]:
        file = self._where.get(name)
        if file is None:
            where = self.index_file if self.index_file is not None else self.path / SINGLE
            close = difflib.get_close_matches(name, self._where, n=3)
            hint = f"; similar: {close}" if close else ""
            raise LoadError(where, f"missing from the checkpoint ({len(self)} tensors){hint}", name)
        shard = self._shards[file]
        return shard, shard.entries[name]

    def info(self, name: str) -> TensorInfo:
        """(safetensors dtype string, shape, path of the file holding it)."""
        shard, e = self._entry(name)
        return TensorInfo(e.dtype, e.shape, str(shard.path))

    def get(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of ``name`` (BF16 as ``ml_dtypes.bfloat16``, F8_E4M3 as ``float8_e4m3fn``,
        F8_E5M2 as ``float8_e5m2``, F8_E8M0 as ``float8_e8m0fnu``, the rest as their NumPy dtypes)."""
        shard, e = self._entry(name)
        try:
            return shard.view(e)
        except (OSError, ValueError) as err:
            raise LoadError(shard.path, f"cannot map: {err}", name) from err

    def get_f32(self, name: str) -> np.ndarray:
        """``name`` widened to a new float32 array."""
        return np.array(self.get(name), dtype=np.float32)

    def require(self, name: str, shape: Sequence[int | None] | None = None,
                dtypes: str | Iterable[str] | None = None) -> np.ndarray:
        """:meth:`get` after checking that ``name`` exists, has ``shape`` (None entries match any size) and one of
        ``dtypes`` (safetensors strings such as ``"BF16"``); LoadError naming file and tensor otherwise."""
        shard, e = self._entry(name)
        if shape is not None:
            want = tuple(shape)
            if len(want) != len(e.shape) or any(w is not None and w != g for w, g in zip(want, e.shape, strict=True)):
                raise LoadError(shard.path, f"expected shape {_shape_str(want)}, got {_shape_str(e.shape)}", name)
        if dtypes is not None:
            allowed = (dtypes,) if isinstance(dtypes, str) else tuple(dtypes)
            if e.dtype not in allowed:
                raise LoadError(shard.path, f"expected dtype {' or '.join(allowed)}, got {e.dtype}", name)
        return self.get(name)

    def metadata(self, file: str | None = None) -> dict[str, str]:
        """The ``__metadata__`` of one file (by name; default: the first), or {}."""
        shard = self._shards[file] if file is not None else next(iter(self._shards.values()))
        return dict(shard.metadata or {})

    def quantization(self) -> Quantization:
        """:func:`quantization` of this directory's config (and ``hf_quant_config.json``)."""
        return quantization(self.config, self.hf_quant_config, file=self.path / CONFIG)

    def close(self) -> None:
        """Drop the memory maps (views handed out keep theirs alive)."""
        for s in self._shards.values():
            s.mm = None

    def __enter__(self) -> SafetensorsDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- quantization configs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quantization:
    """A normalized checkpoint quantization scheme.

    ``method``: ``"none"``, ``"fp8_block"`` (DeepSeek-style block FP8), ``"nvfp4_modelopt"``,
    ``"nvfp4_compressed"`` (compressed-tensors ``nvfp4-pack-quantized``) or ``"mxfp4"`` (gpt-oss).
    ``expert_format``: the :mod:`freetoken.formats` name the routed experts load into (``"bf16"`` for
    unquantized checkpoints, ``"ds_fp4"`` for DeepSeek-V4's ``expert_dtype: fp4``).
    ``block``: weight block shape (``(128, 128)`` for fp8_block, ``(16,)`` for nvfp4, ``(32,)`` for mxfp4).
    ``ignore``: module names / patterns the checkpoint leaves unquantized. ``raw``: the source dict.
    """

    method: str
    expert_format: str
    block: tuple[int, ...] | None = None
    ignore: tuple[str, ...] = ()
    source: str = ""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


SUPPORTED_QUANTIZATION = ("fp8 (with weight_block_size [128, 128])", "modelopt NVFP4",
                          "compressed-tensors nvfp4-pack-quantized", "mxfp4")


def _str_list(x: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in x) if isinstance(x, (list, tuple)) else ()


def quantization(config: dict[str, Any], hf_quant_config: dict[str, Any] | None = None,
                 file: str | os.PathLike = CONFIG) -> Quantization:
    """Describe the quantization of a checkpoint from its ``config.json`` dict (``quantization_config``) and,
    for ModelOpt exports, ``hf_quant_config.json``. LoadError (naming ``file``) for unknown or unsupported
    methods and variants."""
    qc = config.get("quantization_config")
    src = Path(file)
    if qc is None and hf_quant_config is not None:
        qc, src = {"quant_method": "modelopt"}, src.with_name(HF_QUANT_CONFIG)
    if qc is None:
        return Quantization("none", "bf16", source=str(file))
    if not isinstance(qc, dict):
        raise LoadError(file, f"quantization_config is a {type(qc).__name__}, expected an object")
    method = qc.get("quant_method")
    if not isinstance(method, str):
        raise LoadError(file, "quantization_config has no quant_method")
    m = method.lower()
    if m == "fp8":
        return _fp8(qc, config, file)
    if m == "modelopt":
        return _modelopt(qc, hf_quant_config, file, src)
    if m == "compressed-tensors":
        return _compressed_tensors(qc, file)
    if m == "mxfp4":
        return Quantization("mxfp4", "mxfp4", (32,), _str_list(qc.get("modules_to_not_convert")), str(file), qc)
    raise LoadError(file, f"unknown quantization method {method!r} (supported: {', '.join(SUPPORTED_QUANTIZATION)})")


def _fp8(qc: dict, config: dict, file) -> Quantization:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise LoadError(file, f"unsupported fp8 format {fmt!r} (block FP8 needs e4m3)")
    block = qc.get("weight_block_size")
    if block is None:
        raise LoadError(file, "unsupported fp8 variant: no weight_block_size (per-tensor FP8); block FP8 needs "
                              "weight_block_size [128, 128]")
    if not isinstance(block, list) or block != [128, 128]:
        raise LoadError(file, f"unsupported fp8 weight_block_size {_short(block)} (freetoken's fp8_block uses "
                              "[128, 128])")
    ignore = _str_list(qc.get("modules_to_not_convert")) + _str_list(qc.get("ignored_layers"))
    expert = "ds_fp4" if str(config.get("expert_dtype", "")).lower() == "fp4" else "fp8_block"
    return Quantization("fp8_block", expert, (128, 128), ignore, str(file), qc)


def _modelopt(qc: dict, hf_quant_config: dict | None, file, src: Path) -> Quantization:
    sections = [qc, qc.get("quantization")]
    if hf_quant_config is not None:
        sections += [hf_quant_config.get("quantization"), hf_quant_config]
    sections = [s for s in sections if isinstance(s, dict)]
    algo = next((s["quant_algo"] for s in sections if s.get("quant_algo")), None)
    where = src if algo is not None and "quant_algo" not in qc else Path(file)
    if algo is None:
        raise LoadError(file, f"modelopt quantization without quant_algo (and no usable {HF_QUANT_CONFIG})")
    if str(algo).upper() != "NVFP4":
        raise LoadError(where, f"unsupported modelopt quant_algo {algo!r} (supported: NVFP4)")
    group = next((s["group_size"] for s in sections if s.get("group_size") is not None), 16)
    if group != 16:
        raise LoadError(where, f"unsupported NVFP4 group_size {group} (NVFP4 uses 16)")
    ignore: tuple[str, ...] = ()
    for s in sections:
        ignore += _str_list(s.get("exclude_modules")) + _str_list(s.get("ignore"))
    merged = {k: v for s in reversed(sections) for k, v in s.items()}
    return Quantization("nvfp4_modelopt", "nvfp4", (16,), tuple(dict.fromkeys(ignore)), str(where), merged)


def _compressed_tensors(qc: dict, file) -> Quantization:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise LoadError(file, f"compressed-tensors config_groups is a {type(groups).__name__}, expected an object")
    def name(v):
        return v if isinstance(v, str) else _short(v)

    formats = {name(qc.get("format"))} if qc.get("format") else set()
    formats |= {name(g.get("format")) for g in groups.values() if isinstance(g, dict) and g.get("format")}
    if formats != {"nvfp4-pack-quantized"}:
        got = sorted(map(str, formats)) or "none"
        raise LoadError(file, f"unsupported compressed-tensors format {got} (supported: nvfp4-pack-quantized)")
    for name, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        if isinstance(w, dict) and (w.get("num_bits", 4) != 4 or w.get("group_size", 16) != 16):
            raise LoadError(file, f"compressed-tensors group {name!r}: nvfp4 wants 4-bit weights in groups of 16, "
                                  f"got num_bits={w.get('num_bits')} group_size={w.get('group_size')}")
    return Quantization("nvfp4_compressed", "nvfp4", (16,), _str_list(qc.get("ignore")), str(file), qc)
