"""Command-line pieces of the miss policy: the ``--moe-mode`` family of flags shared by ``run`` and ``chat``,
hot-expert pinning, and ``freetoken bench bw``."""

from __future__ import annotations

import argparse
import json

BENCH_DESCRIPTION = """\
Benchmarks of this machine that freetoken's decisions depend on.

Subcommands:
  bw   measure host-to-device copies of expert records and the CPU executor's throughput for one expert format,
       store the profile (keyed by GPU, CPU and format) in the cache directory, and print the --moe-mode that
       `--moe-mode auto` will then pick. A profile measured on other hardware is never used.
"""


def add_policy_args(p: argparse.ArgumentParser) -> None:
    from freetoken.cli.args import count, future_value, real

    g = p.add_argument_group("expert-cache misses (gpu/emu devices)")
    from freetoken.policy.runtime import MODES

    g.add_argument("--moe-mode", default="gpu", choices=list(MODES),
                   help="gpu: copy every miss into the cache; cpu: compute misses on the CPU from host memory; "
                        "hybrid: split them by measured PCIe and CPU bandwidth (q*); auto: what `freetoken bench bw` "
                        "recommended for this machine (default gpu)")
    from freetoken.policy.runtime import CACHE_POLICIES

    g.add_argument("--cache-policy", default="auto", choices=list(CACHE_POLICIES),
                   help="how the expert cache picks victims: next_use (evict the expert expected back last, from "
                        "online per-expert statistics; a miss expected back later than every victim is streamed "
                        "through a scratch slot, or with --moe-mode hybrid computed on the CPU where q* says "
                        "so, instead of evicting), lru, or auto (default: next_use with --moe-mode gpu when "
                        "--cache-slots cannot hold every expert, else lru, as under --moe-mode hybrid, whose q* "
                        "split places every miss; `freetoken trace simulate` compares them on recorded routing)")
    g.add_argument("--pcie-gbps", type=real(0.0, above=True), default=None, metavar="GBPS",
                   help="pin the PCIe bandwidth estimate (GB/s)")
    g.add_argument("--cpu-gbps", type=real(0.0, above=True), default=None, metavar="GBPS",
                   help="pin the CPU-executor bandwidth estimate (GB/s)")
    g.add_argument("--future-value", type=future_value, default=0.0, metavar="S|auto|global",
                   help="hybrid: time a fetched expert is worth beyond its step (it may hit later), in seconds, or "
                        "estimated while running: auto (per expert, from its re-use gaps), global (hits per "
                        "residency); default 0, the greedy split")
    g.add_argument("--prefetch", action="store_true",
                   help="copy the next layer's predicted experts (its router on this layer's input) while a "
                        "layer computes; reports the predictor's precision and recall")
    g.add_argument("--pin-hot", type=count(0), default=0, metavar="N",
                   help="keep the N most frequently routed experts in slots that are never evicted "
                        "(frequencies from --pin-trace, else from a warm-up pass over the prompt)")
    g.add_argument("--pin-trace", metavar="FILE", default=None, help="routing trace (npz) for --pin-hot")


def policy_kwargs(args: argparse.Namespace) -> dict:
    """The :func:`freetoken.load` keywords of the flags above (their types checked the values)."""
    return dict(moe_mode=args.moe_mode, pcie_gbps=args.pcie_gbps, cpu_gbps=args.cpu_gbps,
                future_value=args.future_value, prefetch=args.prefetch, cpu_activations=args.cpu_activations,
                cache_policy=args.cache_policy)


def apply_pinning(model, args: argparse.Namespace, prompt: str | None) -> str:
    """Pin ``--pin-hot`` experts; returns a note for the report ('' when nothing was asked)."""
    if not args.pin_hot:
        return ""
    import numpy as np

    from freetoken.policy.pinning import counts_from_routing, counts_from_trace

    experts = model.experts
    if args.pin_trace:
        from freetoken.trace.format import load_trace

        trace = load_trace(args.pin_trace)
        counts, source = counts_from_trace(trace), f"trace {args.pin_trace}"
    else:
        if not prompt:
            raise ValueError("--pin-hot without --pin-trace needs a prompt to warm up on")
        model.logits(model.encode(prompt), last_only=True)  # warm-up pass: the prompt's routing
        counts = counts_from_routing([np.asarray(model.decoder.dev.to_host(r)) for r in experts.last_routing],
                                     model.config.num_experts)
        source = "a warm-up pass over the prompt"
    pinned = experts.pin_hot(counts, args.pin_hot)
    if isinstance(pinned, str):  # the runner cannot pin (the cpu device): its note says why
        return pinned
    return f"pinned {len(pinned)} hot experts (asked {args.pin_hot}) from {source}"


# ---- freetoken bench bw ---------------------------------------------------------------------------------------


def _cmd_bw(args: argparse.Namespace) -> int:
    from freetoken.device import get_device
    from freetoken.policy.measure import DEFAULT_SHAPE, layout_for, measure_cpu, measure_pcie
    from freetoken.policy.profile import Profile, now, recommend_mode, save_profile, this_hardware

    dev = get_device(args.device)
    fmt, hidden, inter = args.format, args.hidden or DEFAULT_SHAPE[0], args.inter or DEFAULT_SHAPE[1]
    if args.model is not None:
        fmt, hidden, inter = _model_record(args.model)
    args.format = fmt
    layout = layout_for(fmt, hidden, inter)
    gpu, cpu = this_hardware(dev)
    pcie = None
    if dev.kind != "cpu":
        pcie = measure_pcie(dev, layout, records=args.records)
    cpu_bw = measure_cpu(layout, top_k=args.top_k)
    out = {"gpu": gpu, "cpu": cpu, "format": args.format, "record_bytes": layout.record_bytes,
           "pcie_gbps": pcie, "cpu_gbps": cpu_bw}
    if pcie is not None:
        p = Profile(gpu=gpu, cpu=cpu, fmt=args.format, pcie_gbps=pcie, cpu_gbps=cpu_bw,
                    record_bytes=layout.record_bytes, measured_at=now())
        out["profile"] = str(save_profile(p))
        out["recommended_mode"] = recommend_mode(p)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"device {dev.kind} ({gpu}); CPU {cpu}; format {args.format}, records of {layout.record_bytes:,} bytes "
          f"({hidden} x {inter})")
    if pcie is not None:
        print(f"PCIe (copy kernel, host pool -> slots): {pcie:8.1f} GB/s"
              + ("   [emu: host memcpy, not a PCIe figure]" if dev.kind == "emu" else ""))
    print(f"CPU executor (1 token, top-{args.top_k}):   {cpu_bw:8.1f} GB/s")
    if pcie is None:
        print("no PCIe on the cpu device: every expert runs on the CPU; no profile written")
    else:
        print(f"recommended: --moe-mode {out['recommended_mode']}   (profile saved to {out['profile']}; "
              "`--moe-mode auto` uses it on this machine)")
    return 0


def _model_record(path: str) -> tuple[str, int, int]:
    """(expert format, hidden, expert FFN) of a model as ``freetoken run`` would load it, from its config only."""
    from pathlib import Path

    from freetoken.loaders import GGUFFile, SafetensorsDir, quantization
    from freetoken.models.config import GGUF_FAMILIES, from_gguf, from_hf

    p = Path(path)
    if p.is_file():
        gf = GGUFFile(p, archs=tuple(GGUF_FAMILIES))
        cfg = from_gguf(gf)
        first = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
        try:
            fmt = gf.expert_formats(first)[0]  # gate/up's (a Q4_K_M file's down may differ in some layers)
        except Exception:
            fmt = "bf16"
        return fmt, cfg.hidden, cfg.moe_inter
    sd = SafetensorsDir(p)
    cfg = from_hf(sd.config, str(p / "config.json"))
    return quantization(sd.config, sd.hf_quant_config).expert_format, cfg.hidden, cfg.moe_inter


def add_bench_parser(sub) -> None:
    from freetoken import formats

    bench = sub.add_parser("bench", help="measure this machine (bw: PCIe and CPU bandwidth for --moe-mode auto)",
                           description=BENCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = bench.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)
    bw = bsub.add_parser("bw", help="PCIe and CPU-executor bandwidth; stores a profile",
                         description="Measure PCIe copies and the CPU executor once and store the profile.")
    bw.add_argument("--device", default="auto", choices=["auto", "gpu", "cpu", "emu"])
    bw.add_argument("--model", default=None,
                    help="measure with this model's expert format and record shape (overrides the three below)")
    bw.add_argument("--format", default="q4_0", choices=list(formats.NAMES), help="expert format (default q4_0)")
    from freetoken.cli.args import count

    bw.add_argument("--hidden", type=count(1), default=None, help="record shape: hidden size (default 2048)")
    bw.add_argument("--inter", type=count(1), default=None, help="record shape: expert FFN size (default 768)")
    bw.add_argument("--records", type=count(1), default=64, help="records per copy measurement (default 64)")
    bw.add_argument("--top-k", type=count(1), default=8, help="experts per token for the CPU measurement (default 8)")
    bw.add_argument("--json", action="store_true", help="print machine-readable JSON")
    bw.set_defaults(func=_cmd_bw)
