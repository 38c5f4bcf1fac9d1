#!/usr/bin/env python
"""Where a kernel launch's time goes on the device: the host's cost per op call against the kernel's own time.

    python bench/launch_overhead.py                      # gpu (a lent machine: bench/gpu_session.sh runs it)
    python bench/launch_overhead.py --device emu         # the same on the emulator (host numbers only mean much
                                                         # for the Python part)
    python bench/launch_overhead.py --device emu --step --json   # the bundled model's decode step: launches, host us

For a few registry cases at small shapes: host microseconds per op call (N calls issued back to back, then one
synchronize), device microseconds per call measured with events over the same N calls (the GPU idles between
kernels when the host is slower, so this is max(host, kernel)), and the kernel-only time of one call measured
after a warm-up. Then a cProfile of the slowest case's calls, top functions by own time, so the Python part
can be cut without a GPU at hand.

``--step``: the bundled model's eager decode step instead (one token appended to a 32-token sequence, ``--steps``
times after a warm-up): kernel launches per step (every gpu/emu launch is counted by name,
:mod:`freetoken.device.launches`), the most launched kernels, the wall time per step and, on emu, the host's part
of it (the wall time less the time spent inside the emulated kernels; the timing wrapper itself adds about a
microsecond a launch). ``--json`` prints that as one JSON object (``launches_per_step_eager``,
``host_us_per_step_eager``, ``wall_us_per_step_eager``, ``launches_by_kernel``). A captured step (issue 44 item 1)
is not built yet, so there are no captured figures.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
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
    parser.add_argument("--step", action="store_true", help="the bundled model's decode step instead of single ops")
    parser.add_argument("--steps", type=int, default=16, help="decode steps measured with --step (default 16)")
    parser.add_argument("--json", action="store_true", help="with --step: one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.step:
        return step_main(args)

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


@contextlib.contextmanager
def _emu_kernel_time(seconds: list[float]):
    """Adds the time spent inside emulated kernels (the compiled launch call) to ``seconds[0]`` while active."""
    from freetoken.device.emu import EmuFunction

    call = EmuFunction.__call__

    def timed(self, *a, **kw):
        fn = self._fn

        def run(la):
            t = time.perf_counter()
            try:
                return fn(la)
            finally:
                seconds[0] += time.perf_counter() - t

        self._fn = run
        try:
            return call(self, *a, **kw)
        finally:
            self._fn = fn

    EmuFunction.__call__ = timed
    try:
        yield
    finally:
        EmuFunction.__call__ = call


def measure_step(device: str, steps: int) -> dict:
    """The bundled model's eager decode step on ``device`` (see the module doc)."""
    from freetoken.device import device_status, launches
    from freetoken.engine.loading.load import load

    ok, why = device_status()[device]
    if not ok:
        raise RuntimeError(f"no {device} device ({why})")
    model = load(device=device, ctx=256)
    dec = model.decoder
    dec.reset()
    dec.forward(np.arange(3, 35, dtype=np.int64), last_only=True)
    tok = 7
    for _ in range(2):  # warm-up: every kernel of the step built and loaded
        dec.forward(np.array([tok], np.int64))
    inside = [0.0]
    before = launches.snapshot()
    with _emu_kernel_time(inside) if device == "emu" else contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = dec.forward(np.array([tok], np.int64))
            tok = int(np.argmax(logits[-1]))
        wall = time.perf_counter() - t0
    counts = launches.snapshot() - before
    n = sum(counts.values())
    return {"device": device, "model": "bundled", "steps": steps,
            "launches_per_step_eager": n / steps,
            "host_us_per_step_eager": (wall - inside[0]) / steps * 1e6 if device == "emu" else None,
            "wall_us_per_step_eager": wall / steps * 1e6,
            "launches_by_kernel": {k: v / steps for k, v in counts.most_common()}}


def step_main(args) -> int:
    if args.device == "gpu":
        from freetoken.device import device_status

        ok, why = device_status()["gpu"]
        if not ok:
            print(f"launch_overhead: no gpu device ({why})")
            return 0
    r = measure_step(args.device, args.steps)
    if args.json:
        print(json.dumps(r))
        return 0
    host = r["host_us_per_step_eager"]
    print(f"bundled model decode step on {r['device']} (eager, {r['steps']} steps): "
          f"{r['launches_per_step_eager']:.1f} launches a step, wall {r['wall_us_per_step_eager']:.0f} us a step"
          + (f", host {host:.0f} us a step" if host is not None else ""))
    for name, per in r["launches_by_kernel"].items():
        print(f"  {name:<40} {per:6.1f} a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
