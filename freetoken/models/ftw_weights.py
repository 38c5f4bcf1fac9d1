"""An FTW file as decoder weights (:class:`FTWWeights`), and its model config.

An FTW file stores the decoder's own view of a model: its :class:`ModelConfig` fields, every tensor under the
canonical key the decoder reads (``embed``, ``blk.3.q_proj``, ...) in HF order, already past the per-source fixes
the HF and GGUF readers apply (fused projections split, llama's rotary rows unpermuted, ...), and the routed
experts as records in the host pool's layout. So one reader serves every family and every source.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import numpy as np

from freetoken.formats import RecordLayout
from freetoken.formats.parts import ExpertParts
from freetoken.loaders.errors import LoadError
from freetoken.loaders.ftw_file import FLOAT_STORAGES, FTWFile
from freetoken.models.config import ModelConfig
from freetoken.models.qmatrix import QuantizedMatrix
from freetoken.models.weights import Weights


def tensor_name(key: str, layer: int | None = None) -> str:
    """The FTW name of the decoder's weight ``key`` (of ``layer``)."""
    return key if layer is None else f"blk.{layer}.{key}"


def config_to_json(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


#: Upper bound of an FTW config's integers (every size the decoder allocates from is far below it).
_MAX_INT = 2**31 - 1


def _field_value(name: str, hint, value, where: str):
    """``value`` as ``name``'s type (``hint``), or a LoadError naming the field."""
    def bad(why):
        raise LoadError(where, f"model_config.{name}: {why}, got {value!r:.60}", "index")

    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, list):
            bad("expected an array")
        (item, _) = typing.get_args(hint)
        return tuple(_field_value(f"{name}[]", item, v, where) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            bad("expected true or false")
    elif hint is int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_INT:
            bad(f"expected an integer in [0, {_MAX_INT}]")
    elif hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            bad("expected a finite number")
        value = float(value)
    elif hint is str:
        if not isinstance(value, str):
            bad("expected a string")
    elif value is not None and not isinstance(value, dict):  # rope_scaling: dict | None
        bad("expected an object or null")
    return value


def config_from_json(d: dict, where: str) -> ModelConfig:
    """The :class:`ModelConfig` an FTW index holds, every field type- and range-checked (unknown or missing fields,
    an unknown family or RoPE variant refused by name, as LoadError / ConfigError naming the file)."""
    from freetoken.models.config import FAMILIES, ConfigError
    from freetoken.models.rope import rope_frequencies

    if not isinstance(d, dict):
        raise LoadError(where, "model_config is not an object", "index")
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise LoadError(where, f"model_config has fields this freetoken does not know: {unknown} (a newer writer?)",
                        "index")
    missing = sorted(n for n, f in fields.items() if n not in d and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise LoadError(where, f"model_config lacks {missing}", "index")
    hints = typing.get_type_hints(ModelConfig)
    kw = {name: _field_value(name, hints[name], value, where) for name, value in d.items()}
    if kw["family"] not in set(FAMILIES.values()):
        raise LoadError(where, f"model_config.family {kw['family']!r} is not a family this freetoken runs", "index")
    for name in ("vocab_size", "hidden", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        if kw[name] < 1:
            raise LoadError(where, f"model_config.{name} must be at least 1, got {kw[name]}", "index")
    try:
        cfg = ModelConfig(**kw)
        rope_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except (ValueError, TypeError, KeyError, ZeroDivisionError, OverflowError) as e:
        raise LoadError(where, f"model_config: {type(e).__name__}: {e}", "index") from None
    return cfg


def float_tensor(data: np.ndarray, storage: str, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of a stored float tensor (``data``: its bytes)."""
    a = data.view(FLOAT_STORAGES[storage]).reshape(shape)
    if storage == "bf16":
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return a.astype(np.float32)


class FTWWeights(Weights):
    """Weights read from an :class:`FTWFile` (tensors as the index lists them, experts from their records)."""

    def __init__(self, cfg: ModelConfig, ftw: FTWFile):
        self.cfg, self.ftw = cfg, ftw
        self._moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
        self._check_tensors()
        where = str(ftw.path)
        if self._moe and (ftw.hidden, ftw.inter, ftw.bias, ftw.act) != (cfg.hidden, cfg.moe_inter, cfg.expert_bias,
                                                                      cfg.expert_act):
            raise LoadError(where, f"record_layout (hidden {ftw.hidden}, inter {ftw.inter}, bias {ftw.bias}, "
                                   f"{ftw.act}) differs from the model config's experts (hidden {cfg.hidden}, inter "
                                   f"{cfg.moe_inter}, bias {cfg.expert_bias}, {cfg.expert_act})", "index")
        ftw.check_experts(self._moe, cfg.num_experts)
        self._parts = {i: self._layer_parts(i) for i in self._moe}
        first = self._parts[self._moe[0]] if self._moe else None
        if first is not None and not first.mixed:
            lay = first.layouts[0]
            self.native_expert_format = lay.fmt.name if lay.down_fmt is None else lay.name

    def _layer_parts(self, layer: int) -> ExpertParts:
        """The layer's experts grouped by their records' layouts (one part unless the file mixes formats there)."""
        by_layout: dict = {}
        for e in range(self.cfg.num_experts):
            by_layout.setdefault(self.ftw.layout_of(self.ftw.records[(layer, e)]), []).append(e)
        # the part order fixes the local numbering: the layout of expert 0 first, then by first expert
        return ExpertParts([(lay, np.asarray(ids)) for lay, ids in by_layout.items()])

    def _check_tensors(self) -> None:
        """Every tensor the decoder reads is in the file with the shape the config gives it; nothing else is."""
        from freetoken.models.weights import global_shapes, layer_shapes

        where = str(self.ftw.path)
        want = {}
        for layer in (None, *range(self.cfg.num_layers)):
            shapes = global_shapes(self.cfg) if layer is None else dict(layer_shapes(self.cfg, layer))
            if "lin_ba" in shapes:  # stored apart, as the decoder reads them (decoder_keys in the writer)
                rows, h = shapes.pop("lin_ba")
                shapes.update(lin_b=(rows // 2, h), lin_a=(rows // 2, h))
            want.update({tensor_name(k, layer): tuple(v) for k, v in shapes.items()})
        for name, shape in want.items():
            t = self.ftw.tensors.get(name)
            if t is None:
                raise LoadError(where, f"no tensor {name!r}, which the model config needs", name)
            if t.shape != shape:
                raise LoadError(str(self.ftw.file_of(t)), f"tensor {name}: shape {list(t.shape)}, the model config "
                                                          f"gives {list(shape)}", name)
        stray = sorted(set(self.ftw.tensors) - set(want))
        if stray:
            raise LoadError(where, f"tensors the model config has no use for: {stray[:5]}", stray[0])

    def name(self, key: str, layer: int | None = None) -> str:
        return tensor_name(key, layer)

    def has(self, key: str, layer: int | None = None) -> bool:
        return tensor_name(key, layer) in self.ftw.tensors

    def _entry(self, key: str, layer: int | None):
        name = tensor_name(key, layer)
        if name not in self.ftw.tensors:
            raise LoadError(str(self.ftw.path), f"no tensor {name!r} in the file", name)
        return self.ftw.tensors[name]

    def quantized_kind(self, key: str, layer: int | None = None) -> str | None:
        if not self.has(key, layer):
            return None
        t = self._entry(key, layer)
        return None if t.storage in FLOAT_STORAGES else t.storage

    def get_matrix(self, key: str, layer: int | None = None) -> np.ndarray | QuantizedMatrix:
        t = self._entry(key, layer)
        data = self.ftw.tensor_bytes(t.name)
        if t.storage in FLOAT_STORAGES:
            return float_tensor(data, t.storage, t.shape)
        blocks = np.array(data).reshape(t.shape[0], -1)  # a host copy, as the GGUF reader makes one
        return QuantizedMatrix(t.storage, blocks, t.shape)

    def get(self, key: str, layer: int | None = None) -> np.ndarray:
        w = self.get_matrix(key, layer)
        return w.dequantize() if isinstance(w, QuantizedMatrix) else w

    def native_expert_formats(self, layer: int) -> tuple[str, str] | None:
        parts = self._parts.get(layer)
        if parts is None or parts.mixed:
            return None
        lay = parts.layouts[0]
        return lay.fmt.name, lay.format_of("down").name

    def expert_parts(self, layer: int) -> ExpertParts | None:
        """The layer's parts when its records mix formats, else None."""
        parts = self._parts.get(layer)
        return parts if parts is not None and parts.mixed else None

    #: :meth:`expert_banks` takes ``out``: the records are copied into the caller's arrays (the host pool).
    fills_in_place = True

    def expert_banks(self, layer: int, layout: RecordLayout, experts=None, out: dict | None = None
                     ) -> dict[str, np.ndarray]:
        """Banks [n, ...] of ``experts`` (default: all, in order): copied record by record where a record is stored
        in ``layout``, else decoded and quantized to ``layout`` (a load with another ``expert_format``, or a mixed
        layer's records brought to one layout). ``out``: arrays of those shapes to write them into (then no
        per-layer temporary is made for records stored in ``layout``), returned."""
        ids = np.arange(self.cfg.num_experts) if experts is None else np.asarray(experts, np.int64).reshape(-1)
        stored = [self.ftw.layout_of(self.ftw.records[(layer, int(e))]) for e in ids]
        for lay in stored:
            if layout.bias != lay.bias or (layout.hidden, layout.inter) != (lay.hidden, lay.inter):
                raise LoadError(str(self.ftw.path), f"layer {layer}: the records are {lay}, the decoder wants "
                                                    f"{layout}", f"layer {layer}")
        if out is None:
            out = {s.name: np.empty((ids.size, *s.shape), s.dtype) for s in layout.bank_specs()}
        else:
            for s in layout.bank_specs():
                a = out.get(s.name)
                if a is None or a.shape != (ids.size, *s.shape) or a.dtype != s.dtype:
                    got = "missing" if a is None else f"{a.dtype} {list(a.shape)}"
                    raise ValueError(f"layer {layer}: out[{s.name!r}] must be {s.dtype} {[ids.size, *s.shape]}, "
                                     f"got {got}")
        convert = [j for j, lay in enumerate(stored) if lay != layout]
        for j, e in enumerate(ids):
            if stored[j] == layout:
                for name, a in self.ftw.record_banks(layer, int(e)).items():
                    out[name][j] = a
        for lay in dict.fromkeys(stored[j] for j in convert):  # each stored layout's records decoded together
            rows = [j for j in convert if stored[j] == lay]
            banks = {s.name: np.stack([self.ftw.record_banks(layer, int(ids[j]))[s.name] for j in rows])
                     for s in lay.bank_specs()}
            f = lay.dequantize(banks)
            biases = {m: f[f"{m}.b"] for m in ("gate", "up", "down")} if layout.bias else None
            for name, a in layout.quantize(f["gate"], f["up"], f["down"], biases).items():
                out[name][rows] = a
        return out
