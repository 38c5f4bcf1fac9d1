"""Routing trace files: what the model runner records and the cache simulator replays.

A trace is one compressed NumPy archive (``numpy.savez_compressed``, usually named ``*.npz``) with these fields:

=================  ==============================  ==========================================================
field              dtype / shape                   meaning
=================  ==============================  ==========================================================
``decode_ids``     int16 or int32                  top-k expert ids (0 .. num_experts-1) that every decode step
                   ``[steps, layers, tokens, k]``  routed each token of the decode batch to, per MoE layer.
                                                   ``tokens`` is the decode batch size (usually 1). The k ids of
                                                   one token are distinct.
``step_segment``   int32 ``[steps]``               the segment (prompt / turn) each decode step belongs to:
                                                   0 .. segments-1, non-decreasing.
``prefill_counts`` int32                           how many prefill tokens were routed to each expert during
                   ``[segments, layers, experts]`` that segment's prefill (non-negative).
``version``        int scalar                      format version, 1.
``num_experts``    int scalar                      routed experts per MoE layer (E).
``num_layers``     int scalar                      MoE layers (L); layer i is the i-th MoE layer, not the i-th
                                                   transformer block.
``top_k``          int scalar                      experts per token (k).
``record_bytes``   int scalar                      bytes of one expert record (every bank of one expert), i.e.
                                                   what one cache load copies.
``model``          str scalar, optional            a free-form model name.
=================  ==============================  ==========================================================

A segment may have no decode steps (a prompt that was only prefilled). Expert ``e`` of layer ``l`` has the flat
id ``l * num_experts + e``, the identity the GPU expert cache uses. Ids are stored as int16 when ``num_experts``
fits, else int32.

:func:`save_trace` / :func:`load_trace` write and read traces; both validate and raise :class:`TraceError`
(a ``ValueError``) naming the file and the field. :class:`TraceRecorder` builds a trace incrementally while a
model runs.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

VERSION = 1
FIELDS = ("decode_ids", "step_segment", "prefill_counts", "version", "num_experts", "num_layers", "top_k",
          "record_bytes")
OPTIONAL_FIELDS = ("model",)


class TraceError(ValueError):
    """A trace is malformed; the message names the file (when there is one) and the field."""


@dataclass
class Trace:
    """An in-memory routing trace; see the module docstring for the fields.

    Treat the arrays as read-only: derived arrays are cached on the object (:meth:`cached`).
    """

    decode_ids: np.ndarray
    step_segment: np.ndarray
    prefill_counts: np.ndarray
    num_experts: int
    num_layers: int
    top_k: int
    record_bytes: int
    model: str = ""
    version: int = VERSION
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def steps(self) -> int:
        return int(self.decode_ids.shape[0])

    @property
    def tokens(self) -> int:
        """Decode batch size (tokens per decode step)."""
        return int(self.decode_ids.shape[2])

    @property
    def num_segments(self) -> int:
        return int(self.prefill_counts.shape[0])

    @property
    def num_flat(self) -> int:
        """Number of flat expert ids, ``num_layers * num_experts``."""
        return self.num_layers * self.num_experts

    def cached(self, key, compute):
        """``compute()``, computed once per ``key`` and kept on the trace (derived arrays, predictions)."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    def validate(self, source: str | os.PathLike | None = None) -> Trace:
        """Check shapes, dtypes and ranges; raise :class:`TraceError` naming ``source`` and the field."""
        validate_trace(self, source)
        return self


def _fail(source, name: str, msg: str) -> TraceError:
    where = f"trace file {os.fspath(source)}" if source is not None else "trace"
    return TraceError(f"{where}: field '{name}': {msg}")


def _scalar_int(source, name: str, value, minimum: int) -> int:
    arr = np.asarray(value)
    if arr.ndim != 0 or not np.issubdtype(arr.dtype, np.integer):
        raise _fail(source, name, f"must be an integer scalar, got dtype {arr.dtype} with shape {arr.shape}")
    v = int(arr)
    if v < minimum:
        raise _fail(source, name, f"must be >= {minimum}, got {v}")
    return v


def _int_array(source, name: str, value, ndim: int) -> np.ndarray:
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.integer):
        raise _fail(source, name, f"must be an integer array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise _fail(source, name, f"must have {ndim} dimensions, got shape {arr.shape}")
    return arr


def validate_trace(t: Trace, source: str | os.PathLike | None = None) -> None:
    """Validate ``t`` in place (scalars become Python ints); raise :class:`TraceError` on the first problem."""
    t.version = _scalar_int(source, "version", t.version, 0)
    if t.version != VERSION:
        raise _fail(source, "version", f"unknown trace version {t.version} (this freetoken reads version {VERSION})")
    t.num_experts = _scalar_int(source, "num_experts", t.num_experts, 1)
    t.num_layers = _scalar_int(source, "num_layers", t.num_layers, 1)
    t.top_k = _scalar_int(source, "top_k", t.top_k, 1)
    t.record_bytes = _scalar_int(source, "record_bytes", t.record_bytes, 1)
    if t.top_k > t.num_experts:
        raise _fail(source, "top_k", f"top_k {t.top_k} exceeds num_experts {t.num_experts}")
    t.model = str(np.asarray(t.model)) if t.model is not None else ""

    ids = _int_array(source, "decode_ids", t.decode_ids, 4)
    steps, layers, tokens, k = ids.shape
    if layers != t.num_layers or k != t.top_k:
        raise _fail(source, "decode_ids", f"shape {ids.shape} does not match [steps, num_layers={t.num_layers}, "
                                          f"tokens, top_k={t.top_k}]")
    if tokens < 1 and steps > 0:
        raise _fail(source, "decode_ids", f"shape {ids.shape}: needs at least one token per step")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= t.num_experts:
            bad = lo if lo < 0 else hi
            where = np.argwhere((ids < 0) | (ids >= t.num_experts))[0]
            raise _fail(source, "decode_ids", f"expert id {bad} out of range [0, {t.num_experts}) "
                                              f"(first at [step, layer, token, k] = {where.tolist()})")
        if k > 1:
            srt = np.sort(ids, axis=-1)
            dup = srt[..., 1:] == srt[..., :-1]
            if dup.any():
                where = np.argwhere(dup.any(-1))[0]
                raise _fail(source, "decode_ids", f"repeated expert id within one token's top-k "
                                                  f"(first at [step, layer, token] = {where.tolist()})")
    t.decode_ids = ids

    seg = _int_array(source, "step_segment", t.step_segment, 1)
    if seg.shape != (steps,):
        raise _fail(source, "step_segment", f"shape {seg.shape} does not match [steps={steps}]")

    pc = _int_array(source, "prefill_counts", t.prefill_counts, 3)
    if pc.shape[1:] != (t.num_layers, t.num_experts):
        raise _fail(source, "prefill_counts", f"shape {pc.shape} does not match [segments, num_layers="
                                              f"{t.num_layers}, num_experts={t.num_experts}]")
    if pc.size and int(pc.min()) < 0:
        raise _fail(source, "prefill_counts", "counts must be non-negative")
    nseg = pc.shape[0]
    if steps:
        if nseg == 0:
            raise _fail(source, "prefill_counts", "no segments, but the trace has decode steps")
        if int(seg.min()) < 0 or int(seg.max()) >= nseg:
            raise _fail(source, "step_segment", f"segment index out of range [0, {nseg}) "
                                                f"(segments = prefill_counts.shape[0])")
        if steps > 1 and (np.diff(seg) < 0).any():
            raise _fail(source, "step_segment", "segment indices must be non-decreasing")
    t.step_segment = seg
    t.prefill_counts = pc


def save_trace(path: str | os.PathLike, trace: Trace) -> None:
    """Validate ``trace`` and write it to ``path`` as a compressed .npz (the name is used as given)."""
    trace.validate()
    id_dtype = np.int16 if trace.num_experts <= np.iinfo(np.int16).max + 1 else np.int32
    arrays = {
        "decode_ids": np.ascontiguousarray(trace.decode_ids, dtype=id_dtype),
        "step_segment": np.ascontiguousarray(trace.step_segment, dtype=np.int32),
        "prefill_counts": np.ascontiguousarray(trace.prefill_counts, dtype=np.int32),
        "version": np.int64(trace.version),
        "num_experts": np.int64(trace.num_experts),
        "num_layers": np.int64(trace.num_layers),
        "top_k": np.int64(trace.top_k),
        "record_bytes": np.int64(trace.record_bytes),
    }
    if trace.model:
        arrays["model"] = np.array(trace.model)
    # A file object keeps numpy from appending ".npz" to names that end otherwise.
    with open(path, "wb") as fh:
        np.savez_compressed(fh, **arrays)


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace written by :func:`save_trace` (or anything with the same fields)."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"trace file {p}: no such file")
    _check_declared_sizes(p)
    try:
        npz = np.load(p, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise TraceError(f"trace file {p}: not an .npz archive (it holds a single {type(npz).__name__})")
        with npz:
            names = set(npz.files)
            missing = [f for f in FIELDS if f not in names]
            if missing:
                raise TraceError(f"trace file {p}: missing field{'s' if len(missing) > 1 else ''} "
                                 f"{', '.join(repr(m) for m in missing)}")
            data = {name: npz[name] for name in FIELDS + OPTIONAL_FIELDS if name in names}
    except TraceError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise TraceError(f"trace file {p}: not a readable .npz archive ({type(e).__name__}: {e})") from None
    model = data.get("model", "")
    if np.asarray(model).dtype.kind not in "US":
        raise TraceError(f"trace file {p}: field 'model': must be a string, got dtype {np.asarray(model).dtype}")
    t = Trace(decode_ids=data["decode_ids"], step_segment=data["step_segment"],
              prefill_counts=data["prefill_counts"], num_experts=data["num_experts"],
              num_layers=data["num_layers"], top_k=data["top_k"], record_bytes=data["record_bytes"],
              model=str(model), version=data["version"])
    validate_trace(t, p)
    for name, cap in (("num_experts", MAX_TRACE_EXPERTS), ("num_layers", MAX_TRACE_LAYERS),
                      ("record_bytes", MAX_TRACE_RECORD_BYTES)):
        if getattr(t, name) > cap:
            raise _fail(p, name, f"{getattr(t, name)} exceeds the limit {cap}")
    return t


#: Limits load_trace states and checks before it reads an array: one array's bytes, whatever the archive claims,
#: and (because a deflate stream expands at most 1032-fold) no more than this many times its compressed size.
MAX_TRACE_ARRAY_BYTES = 1 << 33
MAX_INFLATE_RATIO = 1100
#: Caps on the scalars that size the simulator's tables (flat ids = layers * experts).
MAX_TRACE_EXPERTS = 1 << 14
MAX_TRACE_LAYERS = 1024
MAX_TRACE_RECORD_BYTES = 1 << 40


def _check_declared_sizes(p: Path) -> None:
    """Before NumPy allocates anything: every member's declared array size (its .npy header) must fit the bytes
    the zip entry holds, which must be plausible for its compressed size (stored or deflated only) and under
    :data:`MAX_TRACE_ARRAY_BYTES`. A 10 KB archive declaring 100 million steps is refused here."""
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            if fh.read(6) == b"\x93NUMPY":
                raise TraceError(f"trace file {p}: not an .npz archive (it holds a single ndarray)")
        with zipfile.ZipFile(p) as zf:
            for info in zf.infolist():
                where = f"trace file {p}: member {info.filename!r}"
                if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                    raise TraceError(f"{where}: compression method {info.compress_type} (numpy writes stored or "
                                     "deflated members only)")
                bound = min(info.compress_size, size) * (1 if info.compress_type == zipfile.ZIP_STORED
                                                         else MAX_INFLATE_RATIO) + 1024
                if info.file_size > min(bound, MAX_TRACE_ARRAY_BYTES):
                    raise TraceError(f"{where}: declares {info.file_size} bytes from {info.compress_size} compressed "
                                     f"(at most {min(bound, MAX_TRACE_ARRAY_BYTES)} are possible or allowed)")
                if not info.filename.endswith(".npy"):
                    continue
                with zf.open(info) as fh:
                    version = np.lib.format.read_magic(fh)
                    read = {(1, 0): np.lib.format.read_array_header_1_0,
                            (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                    if read is None:
                        raise TraceError(f"{where}: .npy version {version} (traces are written as 1.0 or 2.0)")
                    shape, _, dtype = read(fh)
                    header = fh.tell()
                if any(d < 0 for d in shape):
                    raise TraceError(f"{where}: negative dimension in shape {shape}")
                declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
                if declared > info.file_size - header:
                    raise TraceError(f"{where}: declares a {dtype} array of shape {shape} ({declared} bytes) but "
                                     f"holds {max(0, info.file_size - header)}")
    except TraceError:
        raise
    except (OSError, ValueError, SyntaxError, TypeError, zipfile.BadZipFile, zlib.error, EOFError, RuntimeError,
            NotImplementedError) as e:
        raise TraceError(f"trace file {p}: not a readable .npz archive ({type(e).__name__}: {e})") from None


def _host(x) -> np.ndarray:
    """A NumPy copy of ``x`` (CuPy arrays come to the host through ``.get()``)."""
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):
        x = x.get()
    return np.array(x, copy=True)


class TraceRecorder:
    """Collects routing while a model runs; :meth:`save` writes the trace file.

    Usage, per prompt / turn::

        rec.begin_segment()
        for layer in moe_layers: rec.add_prefill(layer, topk_ids)        # [T, k] ids of the prefill tokens
        for step in decode:      rec.add_decode_step([ids_l0, ids_l1, ...])  # one [tokens, k] array per layer

    ``add_prefill`` may be called several times per layer (chunked prefill): the counts add up. The decode batch
    size (tokens) must stay the same through a trace. :meth:`add_segment` does all three for one generation (a
    model's ``stats.prefill_routing`` and ``stats.routing``).
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, record_bytes: int, model: str = ""):
        self.num_layers, self.num_experts, self.top_k = int(num_layers), int(num_experts), int(top_k)
        self.record_bytes, self.model = int(record_bytes), model
        self._steps: list[np.ndarray] = []
        self._step_segment: list[int] = []
        self._prefill: list[np.ndarray] = []
        self._tokens: int | None = None

    @property
    def num_segments(self) -> int:
        return len(self._prefill)

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def begin_segment(self) -> int:
        """Start a new segment (prompt or turn); returns its index."""
        self._prefill.append(np.zeros((self.num_layers, self.num_experts), np.int64))
        return len(self._prefill) - 1

    def _check(self, what: str, ids: np.ndarray, layer: int | None = None) -> np.ndarray:
        if not self._prefill:
            raise RuntimeError(f"TraceRecorder.{what}: call begin_segment() first")
        if layer is not None and not 0 <= layer < self.num_layers:
            raise ValueError(f"TraceRecorder.{what}: layer {layer} out of range [0, {self.num_layers})")
        if ids.ndim != 2 or ids.shape[1] != self.top_k:
            raise ValueError(f"TraceRecorder.{what}: ids must have shape [tokens, top_k={self.top_k}], "
                             f"got {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"TraceRecorder.{what}: ids must be integers, got {ids.dtype}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            raise ValueError(f"TraceRecorder.{what}: expert id out of range [0, {self.num_experts})")
        return ids

    def add_prefill(self, layer: int, ids) -> None:
        """Count the prefill routing ``ids`` [T, k] of ``layer`` into the current segment."""
        ids = self._check("add_prefill", _host(ids), layer)
        self._prefill[-1][layer] += np.bincount(ids.ravel(), minlength=self.num_experts)

    def add_segment(self, prefill_routing, decode_routing) -> int:
        """One generation as a segment: ``prefill_routing[l]`` is layer l's [T, k] prompt ids, ``decode_routing`` a
        list of decode steps as :meth:`add_decode_step` takes them. Returns the segment's index."""
        index = self.begin_segment()
        for layer, ids in enumerate(prefill_routing):
            self.add_prefill(layer, ids)
        for step in decode_routing:
            self.add_decode_step(step)
        return index

    def add_decode_step(self, layer_ids) -> None:
        """Record one decode step: ``layer_ids[l]`` is layer l's top-k ids, shape [tokens, k]."""
        if len(layer_ids) != self.num_layers:
            raise ValueError(f"TraceRecorder.add_decode_step: expected {self.num_layers} layers, "
                             f"got {len(layer_ids)}")
        step = np.stack([self._check("add_decode_step", _host(x)) for x in layer_ids])
        if self._tokens is None:
            self._tokens = step.shape[1]
        elif step.shape[1] != self._tokens:
            raise ValueError(f"TraceRecorder.add_decode_step: decode batch changed from {self._tokens} to "
                             f"{step.shape[1]} tokens")
        dtype = np.int16 if self.num_experts <= np.iinfo(np.int16).max + 1 else np.int32
        self._steps.append(step.astype(dtype))
        self._step_segment.append(len(self._prefill) - 1)

    def to_trace(self) -> Trace:
        """The recorded trace (validated)."""
        dtype = np.int16 if self.num_experts <= np.iinfo(np.int16).max + 1 else np.int32
        if self._steps:
            ids = np.stack(self._steps)
        else:
            ids = np.zeros((0, self.num_layers, self._tokens or 1, self.top_k), dtype)
        counts = (np.stack(self._prefill) if self._prefill
                  else np.zeros((0, self.num_layers, self.num_experts), np.int64))
        if counts.size and counts.max() > np.iinfo(np.int32).max:
            raise ValueError("TraceRecorder: a prefill count overflows int32")
        t = Trace(decode_ids=ids, step_segment=np.asarray(self._step_segment, np.int32),
                  prefill_counts=counts.astype(np.int32), num_experts=self.num_experts,
                  num_layers=self.num_layers, top_k=self.top_k, record_bytes=self.record_bytes, model=self.model)
        return t.validate()

    def save(self, path: str | os.PathLike) -> Trace:
        """Write the trace to ``path``; returns it."""
        t = self.to_trace()
        save_trace(path, t)
        return t
