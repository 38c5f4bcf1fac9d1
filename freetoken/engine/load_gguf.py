"""A GGUF file (llama.cpp) -> the decoder and tokenizer of a :class:`freetoken.engine.generate.Model`.

Everything that can be checked before the long work is: the architecture and config come from the metadata
(:func:`freetoken.models.config.from_gguf`), every tensor the decoder will read is looked up by name and shape
first, and the embedded tokenizer is built, so a file with a missing or misshapen tensor fails at once with
a :class:`LoadError` naming the file and the tensor.
"""

from __future__ import annotations

from pathlib import Path

from freetoken.loaders import GGUFFile, LoadError
from freetoken.models.config import GGUF_FAMILIES, ModelConfig, from_gguf
from freetoken.models.weights import GGUFWeights


def _expected_shapes(cfg: ModelConfig, w: GGUFWeights) -> dict[str, tuple[int, ...]]:
    """NumPy-order shape of every tensor the decoder reads (vectors may be stored as [1, n] too)."""
    hd, h = cfg.head_dim, cfg.hidden
    out = {w.name("embed"): (cfg.vocab_size, h), w.name("norm"): (h,)}
    if not cfg.tie_word_embeddings:
        out[w.name("lm_head")] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        s = {"attn_norm": (h,), "mlp_norm": (h,), "q_proj": (cfg.num_heads * hd, h),
             "k_proj": (cfg.num_kv_heads * hd, h), "v_proj": (cfg.num_kv_heads * hd, h),
             "o_proj": (h, cfg.num_heads * hd)}
        if cfg.qkv_bias:
            s.update(q_bias=(cfg.num_heads * hd,), k_bias=(cfg.num_kv_heads * hd,), v_bias=(cfg.num_kv_heads * hd,))
        if cfg.qk_norm == "head":
            s.update(q_norm=(hd,), k_norm=(hd,))
        elif cfg.qk_norm == "full":
            s.update(q_norm=(cfg.num_heads * hd,), k_norm=(cfg.num_kv_heads * hd,))
        if cfg.is_moe(i):
            s["router"] = (cfg.num_experts, h)
            if cfg.shared_inter:
                si = cfg.shared_inter
                s.update(shared_gate=(si, h), shared_up=(si, h), shared_down=(h, si), shared_sigmoid=(h,))
        else:
            d = cfg.dense_inter
            s.update(mlp_gate=(d, h), mlp_up=(d, h), mlp_down=(h, d))
        out.update({w.name(k, i): v for k, v in s.items()})
        if cfg.is_moe(i):
            e, m = cfg.num_experts, cfg.moe_inter
            names = w.gguf.expert_names(i)
            out.update({names["gate"]: (e, m, h), names["up"]: (e, m, h), names["down"]: (e, h, m)})
    return out


def check_tensors(gf: GGUFFile, cfg: ModelConfig, w: GGUFWeights) -> None:
    """LoadError for the first missing or misshapen tensor."""
    for name, want in _expected_shapes(cfg, w).items():
        got = gf.info(name).shape  # LoadError (with close names) when missing
        if tuple(d for d in got if d != 1) != tuple(d for d in want if d != 1):
            raise LoadError(gf.path, f"expected shape {list(want)}, got {list(got)}", name)


def load_gguf(path: Path, device, options):
    """(decoder, tokenizer or None, eos ids, :class:`ChatTemplate` or None) of a GGUF file loaded as ``options``
    (:class:`freetoken.engine.options.LoadOptions`) say."""
    gf = GGUFFile(path, archs=tuple(GGUF_FAMILIES))
    cfg = from_gguf(gf)
    weights = GGUFWeights(cfg, gf)
    check_tensors(gf, cfg, weights)
    meta = gf.tokenizer_meta() if gf.has_meta("tokenizer.ggml.model") else None
    tokenizer = None
    if meta is not None:
        from freetoken.loaders.gguf_tokenizer import tokenizer_from_gguf

        tokenizer = tokenizer_from_gguf(meta, path)
    eos = sorted({meta[k] for k in ("eos_token_id", "eot_token_id") if meta and meta.get(k) is not None})
    template = None
    if meta is not None and meta.get("chat_template"):
        from freetoken.engine.chat import ChatTemplate

        special = {f"{k}_token": meta["tokens"][meta[f"{k}_token_id"]] for k in ("bos", "eos")
                   if meta.get(f"{k}_token_id") is not None}
        template = ChatTemplate(meta["chat_template"], special, name=f"{path.name}: tokenizer.chat_template")
    from freetoken.engine.build import build_decoder

    decoder = build_decoder(cfg, weights, device, options)
    return decoder, tokenizer, eos, template
