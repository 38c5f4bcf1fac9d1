#!/usr/bin/env python
"""Where a kernel launch's time goes on the device: the host's cost per op call against the kernel's own time.

    python bench/launch_overhead.py                      # gpu (a lent machine: bench/gpu_session.sh runs it)
    python bench/launch_overhead.py --device emu         # the same on the emulator (host numbers only mean much
                                                         # for the Python part)

For a few registry cases at small shapes: host microseconds per op call (N calls issued back to back, then one
synchronize), device microseconds per call measured with events over the same N calls (the GPU idles between
kernels when the host is slower, so this is max(host, kernel)), and the kernel-only time of one call measured
after a warm-up. Then a cProfile of the slowest case's calls, top functions by own time, so the Python part
can be cut without a GPU at hand.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np

CASES = ("rms_norm_rows", "rope_f32", "dense_gemv_bf16_sq_t1", "route_softmax_topk_k8_renorm", "moe_decode_q4_0",
         "paged_attention_bf16_t1", "gated_delta_decode")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="gpu", choices=["gpu", "emu"])
    parser.add_argument("--calls", type=int, default=200, help="op calls per measurement (default 200)")
    args = parser.parse_args(argv)

    from freetoken.device import device_status, get_device
    from freetoken.testing.cases import CASES as REGISTRY

    ok, why = device_status()[args.device]
    if not ok:
        print(f"launch_overhead: no {args.device} device ({why})")
        return 0
    dev = get_device(args.device)
    by_name = {c.name: c for c in REGISTRY}
    rng = np.random.default_rng(0)
    print(f"{'case':<30} {'host us/call':>13} {'device us/call':>15} {'one call us':>12}")
    worst, worst_host = None, 0.0
    for name in CASES:
        case = by_name[name]
        state = case.setup(dev, case.make(rng, "small"))
        case.launch(dev, state)
        dev.synchronize()
        t = time.perf_counter()
        for _ in range(args.calls):
            case.launch(dev, state)
        host = (time.perf_counter() - t) / args.calls * 1e6
        dev.synchronize()
        s, e = dev.event(), dev.event()
        s.record()
        for _ in range(args.calls):
            case.launch(dev, state)
        e.record()
        e.synchronize()
        device = s.elapsed_ms(e) / args.calls * 1e3
        singles = []
        for _ in range(20):
            s, e = dev.event(), dev.event()
            dev.synchronize()
            s.record()
            case.launch(dev, state)
            e.record()
            e.synchronize()
            singles.append(s.elapsed_ms(e) * 1e3)
        print(f"{name:<30} {host:>13.1f} {device:>15.1f} {statistics.median(singles):>12.1f}", flush=True)
        if host > worst_host:
            worst, worst_host = (case, state), host
    case, state = worst
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        case.launch(dev, state)
    prof.disable()
    dev.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(f"\ncProfile of {args.calls} calls of {case.name} (own time first):")
    print("\n".join(buf.getvalue().splitlines()[:45]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
