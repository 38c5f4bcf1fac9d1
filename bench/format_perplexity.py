#!/usr/bin/env python
"""What an expert format costs: the bundled model's perplexity on its held-out stdlib files with its routed experts
in each format, each written as an FTW file first (so the numbers are the files' own), beside the experts' bits
per weight.

    python bench/format_perplexity.py                      # bf16 fp8_block nvfp4 mxfp4 q4_0, cpu, float32 activations
    python bench/format_perplexity.py --formats q4_0 q4_k --chunk 256
    python bench/format_perplexity.py --formats bf16 fp8_block mxfp4 --mixed fp8_block:mxfp4:0.1

A ``--mixed HOT:COLD:FRACTION`` row is the file ``freetoken convert --hot HOT --cold COLD --hot-fraction FRACTION
--trace T`` writes, its hot experts counted from the routing of the bf16 model over --trace-tokens tokens of the
model's TRAINING files (the held-out files never choose what is scored on them), the way a user records a trace on
their own workload first.

The held-out files are the 15 that scripts/train_default_model.py kept out of training (its seed and split);
perplexity is llama.cpp's measure (freetoken.engine.generation.perplexity). The CPU runs the experts with float32
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


def training_text(n_chars: int, seed: int = 1234, val_frac: float = 0.02) -> str:
    """The first ``n_chars`` characters of the bundled model's training files, in train_default_model.py's order."""
    import sysconfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from train_default_model import collect_files, read_text, split_files

    train, _ = split_files(collect_files(Path(sysconfig.get_paths()["stdlib"])), val_frac, seed)
    out, size = [], 0
    for p in train:
        t = read_text(p)
        if t is not None:
            out.append(t)
            size += len(t)
            if size >= n_chars:
                break
    return "\n".join(out)[:n_chars]


def routing_counts(tokens: int, chunk: int, device: str):
    """[moe layers, experts] routing counts of the bf16 bundled model over ``tokens`` training tokens, prefilled in
    chunks of ``chunk`` (what a recorded trace's prefill counts hold)."""
    import numpy as np

    from freetoken.engine.loading.load import load
    from freetoken.policy.pinning import counts_from_routing

    model = load(None, device=device, ctx=max(chunk, 64))
    ids = np.asarray(model.encode(training_text(tokens * 6)), np.int32)[:tokens]
    counts = None
    for i in range(0, ids.size - chunk + 1, chunk):
        model.decoder.reset()
        model.decoder.forward(ids[i:i + chunk])
        routing = [model.decoder.dev.to_host(r) for r in model.experts.last_routing]
        c = counts_from_routing(routing, model.config.num_experts)
        counts = c if counts is None else counts + c
    return counts


def parse_mixed(spec: str, known) -> tuple[str, str, float]:
    try:
        hot, cold, frac = spec.split(":")
        frac = float(frac)
    except ValueError:
        raise SystemExit(f"--mixed {spec!r}: expected HOT:COLD:FRACTION, e.g. fp8_block:mxfp4:0.1") from None
    for f in (hot, cold):
        if f not in known:
            raise SystemExit(f"--mixed {spec!r}: unknown format {f!r}")
    return hot, cold, frac


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS))
    parser.add_argument("--chunk", type=int, default=512, help="perplexity chunk (default 512)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "emu", "gpu"])
    parser.add_argument("--cpu-activations", default="f32", choices=["f32", "q8", "auto"])
    parser.add_argument("--mixed", action="append", default=[], metavar="HOT:COLD:FRACTION",
                        help="also a file with each layer's FRACTION most routed experts in HOT, the rest in COLD")
    parser.add_argument("--trace-tokens", type=int, default=16384,
                        help="training tokens whose routing picks the hot experts (default 16384)")
    args = parser.parse_args(argv)

    from freetoken import formats
    from freetoken.convert.ftw_export import write_ftw
    from freetoken.engine.generation.perplexity import perplexity
    from freetoken.engine.loading.load import load
    from freetoken.engine.loading.sources import open_source

    for f in args.formats:
        if f not in formats.NAMES:
            parser.error(f"unknown format {f!r}; choose from {', '.join(formats.NAMES)}")
    mixed = [parse_mixed(m, formats.NAMES) for m in args.mixed]
    text = held_out_text()
    src = open_source(None)
    files = [(fmt, {"expert_format": fmt}) for fmt in args.formats]
    if mixed:
        from freetoken.convert.expert_plan import format_layouts, hot_cold_plan, plan_summary

        counts = routing_counts(args.trace_tokens, args.chunk, args.device)
        for hot, cold, frac in mixed:
            plan = hot_cold_plan(counts, hot, cold, frac)
            print(f"  {hot}:{cold}:{frac:g}: {plan_summary(plan, format_layouts(src.cfg, [hot, cold]))}",
                  file=sys.stderr)
            files.append((f"{frac:.0%} {hot}, rest {cold}", {"expert_plan": plan}))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, how) in enumerate(files):
            t0 = time.perf_counter()
            path = write_ftw(src, Path(tmp) / f"{i}.ftw", **how)
            model = load(path, device=args.device, ctx=max(args.chunk, 64), cpu_activations=args.cpu_activations)
            ids = model.encode(text)
            r = perplexity(model, ids, ctx=args.chunk)
            rows.append((name, _bits_per_weight(model.experts.parts), r, path.stat().st_size))
            print(f"  {name}: {r.line()} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
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


def _bits_per_weight(parts) -> float:
    """Record payload bits over gate + up + down weights, averaged over every routed expert of the model."""
    bits = weights = 0
    for p in parts:
        for lay, experts in zip(p.layouts, p.experts, strict=True):
            bits += len(experts) * lay.record_bytes * 8
            weights += len(experts) * 3 * lay.hidden * lay.inter
    return bits / weights


if __name__ == "__main__":
    raise SystemExit(main())
