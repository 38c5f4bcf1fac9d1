"""Fuzz freetoken's file readers: N mutated inputs per kind, each loaded in a forked child with a timeout and an
address-space limit, and a table of outcomes per kind.

Kinds: ``safetensors`` (a mutated model.safetensors beside a valid config.json), ``gguf`` (a mutated GGUF
file), ``config`` (a mutated config.json beside valid weights), ``trace`` (a mutated routing trace .npz). The seeds
are a 2-layer Qwen3-MoE checkpoint with tiny dimensions, its GGUF export and a small trace
(:func:`freetoken.testing.fuzz.make_seeds`); loading is ``freetoken.load(path, device="cpu")`` for the models and
``load_trace`` + the trace summary for traces (:func:`freetoken.testing.fuzz.load_input`).

Outcomes: ``ok`` (loaded), ``clear`` (LoadError / ConfigError / TraceError naming the file), ``other`` (any other
exception, or one of those not naming the file), ``hang`` (no result within --timeout), ``memory`` (MemoryError
under the --mem-gb limit), ``crash`` (killed by a signal). The goal: 0 other, 0 hang, 0 memory, 0 crash. A few
examples of every non-clear outcome are listed with the arguments that reproduce them (input ``n`` of a kind under
``--seed`` is always the same file; ``--keep DIR`` writes the failing inputs there).

    python bench/fuzz_loaders.py --n 10000 --jobs 2
    python bench/fuzz_loaders.py --kinds gguf --n 1 --start 4711 --keep /tmp/repro   # one input again
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from freetoken.testing import fuzz


def _worker(tasks: list[tuple[str, int]], args, seeds: fuzz.Seeds, conn) -> None:
    mut = fuzz.Mutator(seeds)
    work = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        for kind, n in tasks:
            path = mut.make(kind, n, args.seed, work / kind)
            out = fuzz.run_forked(kind, path, n, timeout=args.timeout, mem_bytes=int(args.mem_gb * 2**30))
            if out.outcome not in ("ok", "clear") and args.keep:
                dest = Path(args.keep) / f"{kind}-{n}{path.suffix}"
                if path.is_dir():
                    shutil.copytree(path, dest, symlinks=False, dirs_exist_ok=True)
                else:
                    shutil.copy(path, dest)
            conn.send((out.kind, out.n, out.outcome, out.detail, out.seconds))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        conn.send(None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(fuzz.KINDS), help="comma-separated: " + ", ".join(fuzz.KINDS))
    ap.add_argument("--n", type=int, default=1000, help="inputs per kind (default 1000)")
    ap.add_argument("--start", type=int, default=0, help="first input number (to reproduce one)")
    ap.add_argument("--seed", type=int, default=0, help="mutation seed (default 0)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per input before it counts as a hang")
    ap.add_argument("--mem-gb", type=float, default=4.0, help="address-space limit of each child (RLIMIT_AS)")
    ap.add_argument("--jobs", type=int, default=1, help="parallel workers (each forks one child at a time)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="stop after this many seconds and report what was done")
    ap.add_argument("--examples", type=int, default=3, help="examples listed per non-clear outcome and kind")
    ap.add_argument("--seeds-dir", type=Path, default=None, help="where the seed files live (default: a temp dir)")
    ap.add_argument("--keep", default=None, help="copy every non-clear input into this directory")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in fuzz.KINDS]
    if bad or not kinds:
        ap.error(f"unknown kinds {bad} (known: {', '.join(fuzz.KINDS)})")
    if args.n < 1 or args.jobs < 1 or args.timeout <= 0 or args.mem_gb <= 0:
        ap.error("--n, --jobs, --timeout and --mem-gb must be positive")
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)

    seeds_root = args.seeds_dir or Path(tempfile.gettempdir()) / "freetoken-fuzz-seeds"
    seeds = fuzz.make_seeds(seeds_root)
    t0 = time.time()
    fuzz.warm_up(seeds)  # children inherit compiled kernels
    print(f"seeds in {seeds_root}; warm-up {time.time() - t0:.1f} s; {args.n} inputs per kind, timeout "
          f"{args.timeout:g} s, {args.mem_gb:g} GB address space, {args.jobs} jobs", file=sys.stderr, flush=True)

    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("fork")
    counts: dict[str, Counter] = defaultdict(Counter)
    examples: dict[tuple[str, str], list] = defaultdict(list)
    slowest: dict[str, float] = defaultdict(float)
    t0 = time.time()
    # kinds interleaved, so that a run cut short by --time-limit (or Ctrl-C) has covered every kind alike
    tasks = [(kind, n) for n in range(args.start, args.start + args.n) for kind in kinds]
    pipes, procs = [], []
    for j in range(args.jobs):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(tasks[j::args.jobs], args, seeds, send), daemon=True)
        p.start()
        send.close()
        pipes.append(recv)
        procs.append(p)
    done, stopped = 0, ""
    try:
        while pipes:
            left = None if args.time_limit is None else args.time_limit - (time.time() - t0)
            if left is not None and left <= 0:
                stopped = f"stopped by --time-limit {args.time_limit:g} s"
                break
            for conn in wait(pipes, timeout=left):
                try:
                    msg = conn.recv()
                except EOFError:
                    msg = None
                if msg is None:
                    pipes.remove(conn)
                    continue
                k, n, outcome, detail, secs = msg
                counts[k][outcome] += 1
                slowest[k] = max(slowest[k], secs)
                if outcome not in ("ok", "clear") and len(examples[k, outcome]) < args.examples:
                    examples[k, outcome].append((n, detail))
                done += 1
                if done % 1000 == 0:
                    print(f"  {done}/{len(tasks)} inputs ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        stopped = "interrupted"
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join()

    print(f"\n{'kind':<12}" + "".join(f"{o:>8}" for o in fuzz.OUTCOMES) + f"{'total':>8}{'slowest':>10}")
    for kind in kinds:
        c = counts[kind]
        print(f"{kind:<12}" + "".join(f"{c[o]:>8}" for o in fuzz.OUTCOMES) + f"{sum(c.values()):>8}"
              f"{slowest[kind]:>9.1f}s")
    print(f"({time.time() - t0:.0f} s; inputs {args.start}.. of each kind, seed {args.seed}, {args.jobs} jobs"
          + (f"; {stopped}" if stopped else "") + ")")
    if examples:
        print("\nexamples (reproduce: --kinds KIND --n 1 --start N --seed S --keep DIR):")
        for (kind, outcome), items in sorted(examples.items()):
            for n, detail in items:
                print(f"  {kind} n={n} {outcome}: {detail}")
    failed = sum(counts[k][o] for k in kinds for o in ("other", "hang", "memory", "crash"))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
