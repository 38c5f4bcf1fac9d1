#!/usr/bin/env python
"""One prepared GPU check: compile every kernel, run every parity case on the GPU, time it, print one table.

    python bench/gpu_check.py                 # on a machine with a GPU (a few minutes at most)
    python bench/gpu_check.py --device emu --size small   # the same script on the emulator (CI runs this)

Columns: kernel, max error against the NumPy reference, pass/FAIL, median time, achieved GB/s and that as a
fraction of the card's device-to-device copy bandwidth measured in the same run. Without a GPU it says so and
exits 0 (exit 1 with --require-gpu). Exit 1 when any case fails. If only moe_prefill_* or the prompt-sized
paged_attention / paged_prefill cases fail, rerun with FREETOKEN_NO_MMA=1 (the prefill kernels' portable twin of the
tensor-core products): passing then points at the tensor-core path.
On a GPU it then runs the bundled model end to end (--model-check, bench/gpu_model_check.py): logits against the
cpu device, decode tokens/s by cache size and --moe-mode, and bench bw's PCIe and CPU figures;
--synthetic FILE.gguf adds a decode table on a larger model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def _copy_bandwidth(dev) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write), the roofline for memory-bound kernels."""
    xp = dev.xp
    n = 256 << 20 if dev.kind == "gpu" else 16 << 20
    a = xp.empty(n // 4, dtype=np.float32)
    b = xp.empty_like(a)
    times = []
    for _ in range(5):
        s, e = dev.event(), dev.event()
        s.record()
        b[...] = a
        e.record()
        e.synchronize()
        times.append(s.elapsed_ms(e))
    return 2 * n / (statistics.median(times[1:]) * 1e-3) / 1e9


def _time_case(dev, case, state, reps: int) -> float:
    times = []
    for _ in range(reps):
        s, e = dev.event(), dev.event()
        s.record()
        case.launch(dev, state)
        e.record()
        e.synchronize()
        times.append(s.elapsed_ms(e))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="gpu", choices=["gpu", "emu"], help="where to run (default gpu)")
    parser.add_argument("--size", default=None, choices=["small", "large"],
                        help="case sizes (default: large on gpu, small on emu)")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per case (median reported)")
    parser.add_argument("--require-gpu", action="store_true", help="exit 1 instead of 0 when there is no GPU")
    parser.add_argument("--model-check", action=argparse.BooleanOptionalAction, default=None,
                        help="also run the bundled model end to end on the device (bench/gpu_model_check.py; "
                             "default: on for gpu, off for emu)")
    parser.add_argument("--synthetic", default=None, metavar="GGUF",
                        help="with --model-check: also time decode on this GGUF (bench/make_synthetic_gguf.py)")
    parser.add_argument("--archs", default="all", choices=["all", "native"],
                        help="compile every source for every target architecture (all, the default: what CI "
                             "checks) or only for this device (native: a lent GPU's minutes go to running)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="compile the sources in N processes (NVRTC and g++ are single-threaded; default 1)")
    parser.add_argument("--only", default=None, metavar="REGEX", help="run only the cases whose name matches")
    parser.add_argument("--deadline-s", type=float, default=None, metavar="S",
                        help="start no case after S seconds from the start; the cases left are listed as not run")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    from freetoken.device import device_status, get_device
    from freetoken.device.nvrtc import TARGET_ARCHS, compile_cubin
    from freetoken.paths import cuda_dir
    from freetoken.testing import max_error
    from freetoken.testing.cases import CASES

    ok, why = device_status()[args.device]
    if not ok:
        print(f"gpu_check: no {args.device} device on this machine ({why}); nothing was checked.")
        return 1 if args.require_gpu else 0
    dev = get_device(args.device)
    size = args.size or ("large" if dev.kind == "gpu" else "small")

    t0 = time.perf_counter()
    sources = sorted(cuda_dir().glob("*.cu"))
    archs = TARGET_ARCHS if args.archs == "all" else ((dev.arch,) if dev.kind == "gpu" else ())
    jobs = [(src, arch) for src in sources for arch in archs]
    if args.jobs > 1 and dev.kind == "emu":  # the emulator's g++ builds go in the same pool
        jobs += [(src, "emu") for src in sources]
    if args.jobs > 1 and jobs:  # fill the cubin (and emu library) caches in parallel; the loads below then read them
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs) as pool:
            # longest first, so the biggest source does not start last
            jobs.sort(key=lambda j: -j[0].stat().st_size)
            list(pool.map(_compile_one, [(str(src), arch) for src, arch in jobs]))
    for src, arch in jobs:
        if arch != "emu":
            compile_cubin(src.read_text(), src.name, arch)
    for src in sources:  # this device's build (the gpu device compiles for its card, emu with g++)
        dev.load_cuda(src.name)
    print(f"compiled {len(sources)} sources for {', '.join(archs) or 'no NVRTC target'} and {dev.kind} "
          f"in {time.perf_counter() - t0:.1f}s")
    if dev.kind == "gpu":
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(dev.index)
        print(f"device: {props['name'].decode() if isinstance(props['name'], bytes) else props['name']} "
              f"(sm_{dev.compute_capability[0]}{dev.compute_capability[1]}, built for {dev.arch})")
    copy_bw = _copy_bandwidth(dev)
    print(f"device copy bandwidth: {copy_bw:.1f} GB/s\n")

    header = f"{'kernel':<22} {'max err':>10} {'status':>6} {'time':>11} {'GB/s':>9} {'of copy':>8} {'TFLOP/s':>8}"
    print(header)
    print("-" * len(header))
    failed = 0
    rng = np.random.default_rng(2026)
    cases = [c for c in CASES if not c.cpu_only]  # (after the others: their draws leave the earlier data as it was)
    if args.only:
        import re

        cases = [c for c in cases if re.search(args.only, c.name)]
    not_run = []
    for case in cases:
        if args.deadline_s is not None and time.perf_counter() - t0 > args.deadline_s:
            not_run.append(case.name)
            continue
        inputs = case.make(rng, size)
        state = case.setup(dev, inputs)
        case.launch(dev, state)
        dev.synchronize()
        got = case.fetch(dev, state)
        want = case.reference(inputs)
        err = max(max_error(got[k], want[k]) for k in want)
        try:
            case.check(got, want)
            status = "ok"
        except AssertionError as e:
            status = "FAIL"
            failed += 1
            print(f"  {case.name}: {e}", file=sys.stderr)
        ms = _time_case(dev, case, state, args.reps)
        gbs = case.bytes_moved(inputs) / (ms * 1e-3) / 1e9
        tflops = case.flops(inputs) / (ms * 1e-3) / 1e12
        print(f"{case.name:<22} {err:>10.2e} {status:>6} {ms * 1e3:>9.1f}us {gbs:>9.2f} {gbs / copy_bw:>7.1%} "
              f"{tflops:>8.3f}", flush=True)
    ran = len(cases) - len(not_run)
    print(f"\n{ran - failed}/{ran} kernels match their NumPy reference "
          f"({size} shapes, median of {args.reps}; times include the op's Python launch overhead)")
    if not_run:
        print(f"{len(not_run)} cases not run (--deadline-s {args.deadline_s:g}): {', '.join(not_run)}")
    if args.model_check if args.model_check is not None else dev.kind == "gpu":
        import os

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_model_check import run as model_check

        failed += model_check(dev.kind, args.synthetic)
    return 1 if failed else 0


def _compile_one(job: tuple[str, str]) -> None:
    from pathlib import Path

    from freetoken.device.nvrtc import compile_cubin

    src = Path(job[0])
    if job[1] == "emu":
        from freetoken.device import get_device

        get_device("emu").load_cuda(src.name)  # built with g++ into the cache the parent then loads from
    else:
        compile_cubin(src.read_text(), src.name, job[1])


if __name__ == "__main__":
    sys.exit(main())
