"""A GGUF file (llama.cpp) -> the decoder and tokenizer of a :class:`freetoken.engine.generation.generate.Model`.

Everything that can be checked before the long work is: the architecture and config come from the metadata
(:func:`freetoken.models.config.from_gguf`), every tensor the decoder will read is looked up by name and shape
first, and the embedded tokenizer is built, so a file with a missing or misshapen tensor fails at once with
a :class:`LoadError` naming the file and the tensor.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from gguf.constants import GGMLQuantizationType

from freetoken.loaders import GGUFFile, LoadError
from freetoken.loaders.memory import check_load_bytes
from freetoken.models.config import GGUF_FAMILIES, ModelConfig, from_gguf
from freetoken.models.weights import (
    GGUF_K_B,
    GGUF_LAYER_NAMES,
    GGUF_V_B,
    GGUFWeights,
    expert_layouts,
    global_shapes,
    layer_shapes,
    load_bytes,
)


def _expected_shapes(cfg: ModelConfig, w: GGUFWeights) -> dict[str, tuple[int, ...]]:
    """NumPy-order shape of every tensor the decoder reads (vectors may be stored as [1, n] too)."""
    out = {w.name(k): v for k, v in global_shapes(cfg).items()}
    for i in range(cfg.num_layers):
        out.update({w.name(k, i): v for k, v in layer_shapes(cfg, i).items()})
        if cfg.mla and not w.has("kv_b_proj", i):  # stored as its two halves (llama.cpp's converter)
            del out[w.name("kv_b_proj", i)]
            h, r = cfg.num_heads, cfg.kv_lora_rank
            out[f"blk.{i}.{GGUF_K_B}"] = (h, r, cfg.qk_nope_dim)
            out[f"blk.{i}.{GGUF_V_B}"] = (h, cfg.v_head_dim, r)
        if cfg.is_moe(i):
            e, m, h = cfg.num_experts, cfg.moe_inter, cfg.hidden
            names = w.gguf.expert_names(i)
            out.update({names["gate"]: (e, m, h), names["up"]: (e, m, h), names["down"]: (e, h, m)})
            if cfg.expert_bias:
                out.update({_bias(names["gate"]): (e, m), _bias(names["up"]): (e, m), _bias(names["down"]): (e, h)})
    return out


def _bias(weight_name: str) -> str:
    """``blk.N.ffn_gate_exps.weight`` -> ``blk.N.ffn_gate_exps.bias``."""
    return weight_name.removesuffix(".weight") + ".bias"


_T = GGMLQuantizationType
#: ggml types a weight may be stored in: floats, and the block types gguf-py decodes (never integers, which
#: would be read as numbers).
_FLOAT_TYPES = (_T.F32, _T.F16, _T.BF16, _T.F64)
_VECTOR_TYPES = (_T.F32, _T.F16, _T.BF16)
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _weight_type_ok(t: int, vector: bool) -> bool:
    if vector:
        return t in _VECTOR_TYPES
    return t in _FLOAT_TYPES or t in _dequantizable()


def _dequantizable() -> frozenset:
    from gguf import quants

    traits = getattr(quants, "_type_traits", None)
    if traits is None:  # pragma: no cover - gguf-py layout change: trust every block type it knows
        return frozenset(t for t in _T if t not in (_T.I8, _T.I16, _T.I32, _T.I64))
    return frozenset(traits)


def check_tensors(gf: GGUFFile, cfg: ModelConfig, w: GGUFWeights, kv_bytes: int = 0,
                  expert_format: str | None = None, allow_widen: bool = False) -> int:
    """LoadError for the first missing, misshapen or mistyped tensor of any layer, for a tensor of a kind the
    decoder reads that the config leaves unread (a layer beyond ``block_count``, q/k norms or biases in some
    layers only, a shared expert...), for a matrix in a block type no storage keeps (unless ``allow_widen``: then
    widened to float32) and for a load whose host memory is not available. (Byte ranges, alignment and overlaps
    were checked when the file was opened.) Returns the bytes the load allocates."""
    expected = _expected_shapes(cfg, w)
    experts = {n for i in range(cfg.num_layers) if cfg.is_moe(i) for n in w.gguf.expert_names(i).values()}
    experts |= {_bias(n) for n in experts} & set(expected)
    dense = 0
    for name, want in expected.items():
        got = gf.info(name)  # LoadError (with close names) when missing
        if tuple(d for d in got.shape if d != 1) != tuple(d for d in want if d != 1):
            raise LoadError(gf.path, f"expected shape {list(want)}, got {list(got.shape)}", name)
        t = _T[got.type]
        vector = sum(d != 1 for d in want) <= 1
        if not _weight_type_ok(t, vector):
            kinds = "F32/F16/BF16" if vector else "a float or block-quantized type gguf-py decodes"
            raise LoadError(gf.path, f"stored as {got.type}, expected {kinds}", name)
        if name not in experts:
            kept = GGUFWeights.kept_kind(got) is not None
            # llama.cpp's split MLA halves (attn_k_b / attn_v_b, [H, ., R]) are read as float32 by design (the decoder
            # puts kv_b back together from them): a known widening, not refused
            split_mla = name.endswith((GGUF_K_B, GGUF_V_B))
            if not kept and not vector and not split_mla and t not in _FLOAT_TYPES and not allow_widen:
                raise LoadError(gf.path, f"stored as {got.type}, a block type no matrix is kept in (kept: "
                                         f"{', '.join(GGUFWeights.QUANTIZED)} and floats); widening it to float32 "
                                         f"would take {4 * math.prod(want):,} bytes for the file's "
                                         f"{gf.tensor_nbytes(name):,}: pass --allow-widen to load it so", name)
            dense += gf.tensor_nbytes(name) if kept else 4 * math.prod(want)
    # every layer alike: nothing of a kind the decoder reads may sit where the config leaves it unread
    known = {}
    for i in range(cfg.num_layers):
        for key in GGUF_LAYER_NAMES:
            known[w.name(key, i)] = key
        for n in w.gguf.expert_names(i).values():
            known[n] = "experts"
    for name in gf.names():
        if name in expected:
            continue
        m = _BLK.match(name)
        if m is None:
            continue
        layer = int(m.group(1))
        if cfg.num_layers <= layer < cfg.num_layers + cfg.mtp_layers:
            continue  # a multi-token-prediction layer (``{arch}.nextn_predict_layers``): not run
        if layer >= cfg.num_layers:
            raise LoadError(gf.path, f"layer {layer} is beyond block_count = {cfg.num_layers}", name)
        if name in known:
            raise LoadError(gf.path, f"{known[name]} tensor that layer {layer} of this config does not use (the "
                                     f"metadata and tensors disagree, or only some layers have it: qk_norm "
                                     f"{cfg.qk_norm}, qkv_bias {cfg.qkv_bias}, shared expert "
                                     f"{cfg.shared_inter or 'none'}, layer {layer} "
                                     f"{'MoE' if cfg.is_moe(layer) else 'dense'})", name)
    if expert_format is None:
        _check_expert_types(gf, cfg, w)
    layouts = expert_layouts(cfg, w, expert_format)
    need = load_bytes(cfg, dense, expert_format, kv_bytes, layouts=layouts)
    if expert_format is None and all(w.native_expert_formats(i) for i in range(cfg.num_layers) if cfg.is_moe(i)):
        need["float32 experts of one layer while quantized"] = 0  # every layer's experts move as stored
    return check_load_bytes(gf.path, need)


def _check_expert_types(gf: GGUFFile, cfg: ModelConfig, w: GGUFWeights) -> None:
    """Experts are kept in their stored format (:data:`freetoken.loaders.gguf_file.EXPERT_FORMATS`) or, when stored as
    floats, held as bf16; a block type no expert format keeps (Q2_K, Q3_K, IQ2_XXS, ...) would have to be widened
    to bf16, several times the file's size in host memory: refused, naming the tensor and its type."""
    from freetoken.loaders.gguf_file import EXPERT_FORMATS

    for i in range(cfg.num_layers):
        if not cfg.is_moe(i):
            continue
        for name in w.gguf.expert_names(i).values():
            t = _T[gf.info(name).type]
            if t not in EXPERT_FORMATS and t not in _FLOAT_TYPES:
                kept = ", ".join(x.name for x in EXPERT_FORMATS)
                raise LoadError(gf.path, f"expert tensor stored as {t.name}: freetoken keeps experts in {kept} (or "
                                         "floats, as bf16); widening it to bf16 would take several times the file's "
                                         "size in host memory", name)


def open_gguf(path: Path, kv_bytes, expert_format: str | None, allow_widen: bool = False):
    """(config, weights, tokenizer or None, eos ids, :class:`ChatTemplate` or None) of a GGUF file, every tensor the
    decoder reads checked first (``kv_bytes``: the KV pool bytes the host-memory check counts, or a function of the
    config giving them)."""
    gf = GGUFFile(path, archs=tuple(GGUF_FAMILIES))
    cfg = from_gguf(gf)
    weights = GGUFWeights(cfg, gf)
    check_tensors(gf, cfg, weights, kv_bytes(cfg) if callable(kv_bytes) else kv_bytes, expert_format, allow_widen)
    meta = gf.tokenizer_meta() if gf.has_meta("tokenizer.ggml.model") else None
    tokenizer = None
    if meta is not None:
        from freetoken.loaders.gguf_tokenizer import tokenizer_from_gguf

        tokenizer = tokenizer_from_gguf(meta, path)
    eos = sorted({meta[k] for k in ("eos_token_id", "eot_token_id") if meta and meta.get(k) is not None})
    template = None
    if meta is not None and meta.get("chat_template"):
        from freetoken.engine.generation.chat import ChatTemplate

        special = {f"{k}_token": meta["tokens"][meta[f"{k}_token_id"]] for k in ("bos", "eos")
                   if meta.get(f"{k}_token_id") is not None}
        template = ChatTemplate(meta["chat_template"], special, name=f"{path.name}: tokenizer.chat_template")
    return cfg, weights, tokenizer, eos, template


def load_gguf(path: Path, device, options):
    """(decoder, tokenizer or None, eos ids, :class:`ChatTemplate` or None) of a GGUF file loaded as ``options``
    (:class:`freetoken.engine.options.LoadOptions`) say."""
    from freetoken.engine.loading.build import build_decoder
    from freetoken.engine.loading.context import kv_load_bytes

    cfg, weights, tokenizer, eos, template = open_gguf(
        path, lambda c: kv_load_bytes(c, device.kind, options), options.expert_format, options.allow_widen)
    decoder = build_decoder(cfg, weights, device, options)
    return decoder, tokenizer, eos, template
