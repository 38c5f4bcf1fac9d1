"""Write a synthetic Qwen3-MoE-shaped Q4_0 GGUF file for decode benchmarks (random weights, the bundled tokenizer).

Default shape: 16 layers, 64 experts, top-8, hidden 1024, expert FFN 384 (Qwen3-30B-A3B's proportions at half
the width), 16 query / 4 KV heads of 64; about 0.7 GB. Expert blocks are random Q4_0 bytes with a scale chosen so
every weight has the variance 1/K of a sensible initialisation (quantizing a float copy would only cost time);
the other matrices are F16 Gaussians (``--other q8_0``: Q8_0). Both freetoken and llama.cpp load the file.

``--arch qwen35moe``: Qwen3.5-35B-A3B's layer pattern and widths at half its hidden size: three Gated DeltaNet
layers for every gated full-attention layer (16 key / 32 value heads of 128, a 4-tap convolution; 16 query / 2 KV
heads of 256, a quarter of each rotated), 256 experts top-8 with FFN 512, a gated shared expert of 512; 8 layers and
hidden 1024 by default (about 2 GB with Q8_0 dense matrices).

``--requantize Q4_K_M`` (or Q5_K_M, Q6_K, Q8_0, IQ4_XS): the file as llama.cpp's own quantizer
(``llama_model_quantize`` of llama-cpp-python, from the Q4_0 file, requantizing) writes that mix, so the
per-tensor types are the ones users download (Q4_K_M: Q4_K gate/up, Q6_K down in some layers, Q6_K output, ...).
K-quant rows need K a multiple of 256, so give such a hidden size and expert FFN (llama.cpp falls back to other
types otherwise); the weights' values are the Q4_0 ones re-rounded, which a speed benchmark does not mind.

    python bench/make_synthetic_gguf.py /tmp/synthetic-moe.gguf
    python bench/make_synthetic_gguf.py /tmp/synthetic-qwen35.gguf --arch qwen35moe --other q8_0
    python bench/make_synthetic_gguf.py /tmp/syn-q4km.gguf --layers 8 --hidden 2048 --moe-inter 768 --requantize Q4_K_M
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

from freetoken.convert.gguf_export import write_gguf
from freetoken.engine.loading.load import DEFAULT_MODEL
from freetoken.loaders.gguf_tokenizer import gguf_tokenizer_fields
from freetoken.models.config import ModelConfig


class SyntheticWeights:
    """The ``get`` / ``expert_stack`` source :func:`write_gguf` reads, drawn from a seeded generator per tensor."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.cfg, self.seed = cfg, seed

    def _rng(self, *key) -> np.random.Generator:
        return np.random.default_rng([self.seed, *(zlib.crc32(str(k).encode()) for k in key)])

    def get(self, key: str, layer: int | None = None) -> np.ndarray:
        c, hd = self.cfg, self.cfg.head_dim
        q_rows = c.num_heads * hd * (2 if c.attn_output_gate else 1)
        shapes = {"embed": (c.vocab_size, c.hidden), "norm": (c.hidden,), "attn_norm": (c.hidden,),
                  "mlp_norm": (c.hidden,), "q_proj": (q_rows, c.hidden),
                  "k_proj": (c.num_kv_heads * hd, c.hidden), "v_proj": (c.num_kv_heads * hd, c.hidden),
                  "o_proj": (c.hidden, c.num_heads * hd), "q_norm": (hd,), "k_norm": (hd,),
                  "router": (c.num_experts, c.hidden), "shared_gate": (c.shared_inter, c.hidden),
                  "shared_up": (c.shared_inter, c.hidden), "shared_down": (c.hidden, c.shared_inter),
                  "shared_sigmoid": (1, c.hidden), "lm_head": (c.vocab_size, c.hidden)}
        if c.layer_types:
            from freetoken.models.weights import linear_shapes

            shapes.update(linear_shapes(c))
        shape = shapes[key]
        if key == "lin_ssm_a":  # decay rates -exp(A_log) for A in [1, 16), as HF initialises A
            return -self._rng(key, layer).uniform(1.0, 16.0, shape).astype(np.float32)
        if key == "lin_dt_bias":
            return np.zeros(shape, np.float32)
        if key == "lin_conv":
            return (self._rng(key, layer).standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        scale = 1.0 if key == "embed" else 1.0 / np.sqrt(shape[-1])
        return (self._rng(key, layer).standard_normal(shape, np.float32) * scale).astype(np.float32)

    def expert_stack(self, layer: int, matrix: str) -> np.ndarray:
        """Random Q4_0 blocks [E, N, K/32 * 18]: an f16 scale d then 16 bytes of nibbles (values d * (q - 8))."""
        c = self.cfg
        n, k = (c.hidden, c.moe_inter) if matrix == "down" else (c.moe_inter, c.hidden)
        rng = self._rng("experts", layer, matrix)
        blocks = np.empty((c.num_experts, n, k // 32, 18), np.uint8)
        # uniform q in [0, 15] -> (q - 8) has variance ~21.25; pick d so weights have variance 1/k
        d = np.float16(1.0 / np.sqrt(21.25 * k))
        blocks[..., :2] = np.frombuffer(d.tobytes(), np.uint8)
        blocks[..., 2:] = rng.integers(0, 256, size=(c.num_experts, n, k // 32, 16), dtype=np.uint8)
        return blocks.reshape(c.num_experts, n, -1)


def synthetic_config(layers=16, experts=64, top_k=8, hidden=1024, moe_inter=384, heads=16, kv_heads=4, head_dim=64,
                     vocab=4096, max_position=4096) -> ModelConfig:
    return ModelConfig(family="qwen3_moe", vocab_size=vocab, hidden=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, num_experts=experts, top_k=top_k,
                       moe_inter=moe_inter, dense_inter=0, norm_topk_prob=True, rms_eps=1e-6, rope_theta=1e6,
                       qk_norm="head", moe_layers=(True,) * layers, tie_word_embeddings=True, max_position=max_position)


def synthetic_qwen35_config(layers=8, experts=256, top_k=8, hidden=1024, moe_inter=512, shared_inter=512, heads=16,
                            kv_heads=2, head_dim=256, vocab=4096, max_position=4096) -> ModelConfig:
    """Qwen3.5-MoE's layer kinds and widths (every 4th layer full attention), at the given size."""
    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers))
    return ModelConfig(family="qwen3_5_moe", vocab_size=vocab, hidden=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, num_experts=experts, top_k=top_k,
                       moe_inter=moe_inter, dense_inter=0, norm_topk_prob=True, rms_eps=1e-6, rope_theta=1e7,
                       qk_norm="head", shared_inter=shared_inter, moe_layers=(True,) * layers,
                       tie_word_embeddings=False, max_position=max_position, rotary_dim=head_dim // 4,
                       layer_types=types, linear_k_heads=16, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128,
                       linear_conv=4, attn_output_gate=True, norm_offset=True)


#: llama.cpp's ``llama_ftype`` of the mixes ``--requantize`` writes.
LLAMA_FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7, "IQ4_XS": 30}


def requantize(src: Path, out: Path, mix: str, threads: int = 0) -> Path:
    """``src`` re-quantized by llama.cpp to the ``mix`` of :data:`LLAMA_FTYPES`, written to ``out``."""
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit(f"--requantize needs llama-cpp-python (bash scripts/setup --llama-cpp): {e}") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[mix]
    params.nthread = threads
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0 or not out.is_file():
        out.unlink(missing_ok=True)  # no partial file left behind
        raise SystemExit(f"llama.cpp could not quantize {src} to {mix} (llama_model_quantize returned {rc})")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", type=Path)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-inter", type=int, default=384)
    ap.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
    ap.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default 4)")
    ap.add_argument("--head-dim", type=int, default=64, help="(default 64)")
    ap.add_argument("--max-position", type=int, default=4096,
                    help="the context the file declares (max_position_embeddings; default 4096)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", choices=("qwen3moe", "qwen35moe"), default="qwen3moe",
                    help="qwen35moe: Qwen3.5-MoE's hybrid layers (the shape options then default to its own, see "
                         "above; --heads/--kv-heads/--head-dim/--top-k/--experts/--moe-inter apply when given)")
    ap.add_argument("--other", choices=("f16", "q8_0"), default="f16", help="type of the non-expert matrices")
    ap.add_argument("--requantize", choices=list(LLAMA_FTYPES), default=None,
                    help="write the file as llama.cpp quantizes it to this mix (needs llama-cpp-python)")
    args = ap.parse_args(argv)
    given = {a for a in ("layers", "experts", "top_k", "hidden", "moe_inter", "heads", "kv_heads", "head_dim")
             if f"--{a.replace('_', '-')}" in (argv if argv is not None else sys.argv)}
    if args.arch == "qwen35moe":
        cfg = synthetic_qwen35_config(**{a: getattr(args, a) for a in given}, max_position=args.max_position)
    else:
        cfg = synthetic_config(layers=args.layers, experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                               moe_inter=args.moe_inter, heads=args.heads, kv_heads=args.kv_heads,
                               head_dim=args.head_dim, max_position=args.max_position)
    tok = gguf_tokenizer_fields(DEFAULT_MODEL / "tokenizer.json", DEFAULT_MODEL / "tokenizer_config.json")
    target = args.output
    if args.requantize:  # the Q4_0 file next to the output (same disk), removed once llama.cpp has read it
        tmp = tempfile.NamedTemporaryFile(dir=args.output.parent, prefix=".q4_0-", suffix=".gguf", delete=False)
        tmp.close()
        target = Path(tmp.name)
    try:
        out = write_gguf(cfg, SyntheticWeights(cfg, args.seed), target, experts="q4_0", other=args.other,
                         tokenizer=tok, name=f"freetoken synthetic {args.arch}", progress=sys.stderr.isatty())
        if args.requantize:
            out = requantize(out, args.output, args.requantize)
    finally:
        if args.requantize:
            target.unlink(missing_ok=True)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
