"""Write a synthetic Qwen3-MoE-shaped Q4_0 GGUF file for decode benchmarks (random weights, the bundled tokenizer).

Default shape: 16 layers, 64 experts, top-8, hidden 1024, expert FFN 384 (Qwen3-30B-A3B's proportions at half
the width), 16 query / 4 KV heads of 64; about 0.7 GB. Expert blocks are random Q4_0 bytes with a scale chosen so
every weight has the variance 1/K of a sensible initialisation (quantizing a float copy would only cost time);
the other matrices are F16 Gaussians. Both freetoken and llama.cpp load the file.

    python bench/make_synthetic_gguf.py /tmp/synthetic-moe.gguf
"""

from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path

import numpy as np

from freetoken.convert.gguf_export import write_gguf
from freetoken.engine.load import DEFAULT_MODEL
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
        shapes = {"embed": (c.vocab_size, c.hidden), "norm": (c.hidden,), "attn_norm": (c.hidden,),
                  "mlp_norm": (c.hidden,), "q_proj": (c.num_heads * hd, c.hidden),
                  "k_proj": (c.num_kv_heads * hd, c.hidden), "v_proj": (c.num_kv_heads * hd, c.hidden),
                  "o_proj": (c.hidden, c.num_heads * hd), "q_norm": (hd,), "k_norm": (hd,),
                  "router": (c.num_experts, c.hidden)}
        shape = shapes[key]
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        scale = 1.0 if key == "embed" else 1.0 / np.sqrt(shape[1])
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
    args = ap.parse_args(argv)
    cfg = synthetic_config(layers=args.layers, experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                           moe_inter=args.moe_inter, heads=args.heads, kv_heads=args.kv_heads,
                           head_dim=args.head_dim, max_position=args.max_position)
    tok = gguf_tokenizer_fields(DEFAULT_MODEL / "tokenizer.json", DEFAULT_MODEL / "tokenizer_config.json")
    out = write_gguf(cfg, SyntheticWeights(cfg, args.seed), args.output, experts="q4_0", other="f16", tokenizer=tok,
                     name="freetoken synthetic qwen3moe", progress=sys.stderr.isatty())
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
