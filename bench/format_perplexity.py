#!/usr/bin/env python
"""What an expert format costs: the bundled model's perplexity on its held-out stdlib files with its routed experts
in each format, each written as an FTW file first (so the numbers are the files' own), beside the experts' bits
per weight.

    python bench/format_perplexity.py                      # bf16 fp8_block nvfp4 mxfp4 q4_0, cpu, float32 activations
    python bench/format_perplexity.py --formats q4_0 q4_k --chunk 256

The held-out files are the 15 that scripts/train_default_model.py kept out of training (its seed and split);
perplexity is llama.cpp's measure (freetoken.engine.perplexity). The CPU runs the experts with float32
activations unless --cpu-activations q8 is given, so the differences are the formats' alone.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_FORMATS = ("bf16", "fp8_block", "nvfp4", "mxfp4", "q4_0")


def held_out_text(seed: int = 1234, val_frac: float = 0.02) -> str:
    """The bundled model's held-out files (train_default_model.py's collect_files and split_files), joined."""
    import sysconfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from train_default_model import collect_files, read_text, split_files

    files = collect_files(Path(sysconfig.get_paths()["stdlib"]))
    kept = {p: t for p, t in zip(files, (read_text(p) for p in files), strict=True) if t is not None}
    _, val = split_files(list(kept), val_frac, seed)
    return "\n".join(kept[p] for p in val)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS))
    parser.add_argument("--chunk", type=int, default=512, help="perplexity chunk (default 512)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "emu", "gpu"])
    parser.add_argument("--cpu-activations", default="f32", choices=["f32", "q8", "auto"])
    args = parser.parse_args(argv)

    from freetoken import formats
    from freetoken.convert.ftw_export import write_ftw
    from freetoken.engine.load import load
    from freetoken.engine.perplexity import perplexity
    from freetoken.engine.sources import open_source

    for f in args.formats:
        if f not in formats.NAMES:
            parser.error(f"unknown format {f!r}; choose from {', '.join(formats.NAMES)}")
    text = held_out_text()
    src = open_source(None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats:
            t0 = time.perf_counter()
            path = write_ftw(src, Path(tmp) / f"{fmt}.ftw", expert_format=fmt)
            model = load(path, device=args.device, ctx=max(args.chunk, 64), cpu_activations=args.cpu_activations)
            ids = model.encode(text)
            r = perplexity(model, ids, ctx=args.chunk)
            lay = model.experts.layouts[0] if hasattr(model.experts, "layouts") else model.experts.layout
            bpw = lay.record_bytes * 8 / (3 * lay.hidden * lay.inter)
            rows.append((fmt, bpw, r, path.stat().st_size))
            print(f"  {fmt}: {r.line()} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    base = rows[0][2]
    print(f"\nheld-out stdlib files ({rows[0][2].tokens} scored tokens, chunks of {args.chunk}; {args.device}, "
          f"{args.cpu_activations} activations)\n")
    print("| experts | bits/weight | perplexity | nll (nats/token) | nll vs first row (paired) | FTW file |")
    print("|---|---|---|---|---|---|")
    for fmt, bpw, r, size in rows:
        d = r.per_token - base.per_token  # the same tokens: the paired error is far smaller than each run's
        se = float(d.std(ddof=1) / len(d) ** 0.5)
        print(f"| {fmt} | {bpw:.2f} | {r.ppl:.4f} | {r.nll:.4f} +- {r.stderr:.4f} | {d.mean():+.4f} +- {se:.4f} | "
              f"{size / 2**20:.1f} MiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
