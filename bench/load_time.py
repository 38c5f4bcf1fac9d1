#!/usr/bin/env python
"""How long a model takes to load from an FTW file, against the same model from its source: a Hugging Face
safetensors checkpoint (bf16) and a GGUF file (Q4_0), each converted to FTW with ``freetoken convert`` (formats
moved bit for bit), and the FTW files loaded with each ``--verify`` mode.

    python bench/load_time.py                     # 8 layers x 32 experts, hidden 1024, expert FFN 384 (~0.6 GB bf16)
    python bench/load_time.py --layers 16 --experts 64 --reps 5

The models are random (transformers' initialisation for the checkpoint, bench/make_synthetic_gguf.py for the GGUF),
written once under --dir. Each load runs on the cpu device in this process after one warm-up load (Numba compiled,
files in the page cache: the numbers are what a second start of a server costs, not a cold disk read); the best of
--reps is reported with the file's bytes per second.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_checkpoint(out: Path, args) -> Path:
    """A random bf16 Qwen3-MoE checkpoint with the bundled tokenizer."""
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    from freetoken.engine.loading.load import DEFAULT_MODEL

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, out / name)
    vocab = json.loads((DEFAULT_MODEL / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                      num_experts=args.experts, num_experts_per_tok=8,
                                      moe_intermediate_size=args.moe_inter, intermediate_size=4 * args.moe_inter,
                                      max_position_embeddings=4096, dtype="bfloat16")
    with torch.device("cpu"):
        model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


def make_gguf(out: Path, args) -> Path:
    if not out.exists():
        subprocess.run([sys.executable, str(ROOT / "bench" / "make_synthetic_gguf.py"), str(out), "--layers",
                        str(args.layers), "--experts", str(args.experts), "--hidden", str(args.hidden),
                        "--moe-inter", str(args.moe_inter)], check=True)
    return out


def convert(src: Path, out: Path) -> Path:
    if not out.exists():
        subprocess.run([sys.executable, "-m", "freetoken", "convert", str(src), str(out)], check=True,
                       stdout=subprocess.DEVNULL)
    return out


def nbytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size


def time_load(path: Path, reps: int, **kw) -> float:
    from freetoken.engine.loading.load import load

    best = float("inf")
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        model = load(path, device="cpu", **kw)
        best = min(best, time.perf_counter() - t0)
        del model
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/freetoken-load-time"), help="where the models are kept")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-inter", type=int, default=384)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)

    d = args.dir / f"L{args.layers}-E{args.experts}-H{args.hidden}-I{args.moe_inter}"
    d.mkdir(parents=True, exist_ok=True)
    hf = make_checkpoint(d / "hf", args)
    gguf = make_gguf(d / "model-q4_0.gguf", args)
    pairs = [("safetensors (bf16)", hf, convert(hf, d / "hf.ftw")),
             ("GGUF (Q4_0)", gguf, convert(gguf, d / "gguf.ftw"))]
    time_load(pairs[0][2], 1)  # warm-up: Numba, imports, page cache
    print(f"\nload on the cpu device, best of {args.reps} (files in the page cache); {args.layers} layers x "
          f"{args.experts} experts, hidden {args.hidden}, expert FFN {args.moe_inter}\n")
    print("| source | source load | FTW --verify full | FTW sample | FTW none | FTW size |")
    print("|---|---|---|---|---|---|")
    for name, src, ftw in pairs:
        t_src = time_load(src, args.reps)
        t = {v: time_load(ftw, args.reps, verify=v) for v in ("full", "sample", "none")}
        size = nbytes(ftw)
        cells = " | ".join(f"{t[v]:.2f} s ({size / t[v] / 1e9:.1f} GB/s)" for v in ("full", "sample", "none"))
        print(f"| {name} | {t_src:.2f} s ({nbytes(src) / t_src / 1e9:.1f} GB/s) | {cells} | {size / 2**20:.0f} MiB |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
