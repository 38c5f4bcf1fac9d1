"""Where freetoken's cpu forward spends its time: routed experts, dense projections, attention, everything else.

Times one prefill of ``--prompt-tokens`` tokens and ``--decode-tokens`` single-token decode steps of a model on
the cpu device (median over ``--reps`` runs after a warm-up), with the ops wrapped by timers for the run (nothing
in freetoken is edited):

* ``experts``: the routed experts (the model's expert runner, ``run``);
* ``dense``: the dense projections (``freetoken.ops.dense``: attention q/k/v and o, the router gate, a shared
  expert, the lm_head; also listed per weight shape);
* ``attention``: the attention itself (``freetoken.ops.paged_attention``, KV already written);
* ``other``: the rest of the forward (embedding, norms, RoPE, routing softmax/top-k, residual adds, Python).

Times are exclusive (a wrapped op called inside another counts only once, for the outer one).

    python bench/profile_split.py /tmp/ftbench/syn16.gguf --prompt-tokens 512
    python bench/bench_decode.py --profile ...   # the same split for each model of the benchmark
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np

CATEGORIES = ("experts", "dense", "attention", "other")


class _Timers:
    """Exclusive wall time per category and per dense shape, over the calls made while ``active``."""

    def __init__(self):
        self.active = False
        self.stack: list[list] = []  # [category, start, child time]
        self.reset()

    def reset(self):
        self.totals = defaultdict(float)
        self.shapes = defaultdict(float)

    def wrap(self, category, fn, shape_of=None):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            frame = [category, time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                took = time.perf_counter() - frame[1]
                self.totals[category] += took - frame[2]
                if self.stack:
                    self.stack[-1][2] += took
                if shape_of is not None:
                    self.shapes[shape_of(*args, **kwargs)] += took - frame[2]
        return timed


def _dense_shape(x, w, storage, *args, **kwargs):
    k = x.shape[1]
    return f"{storage} {w.shape[0]}x{k}"


@contextmanager
def instrumented(model):
    """Wrap ops.dense, ops.paged_attention and the model's expert runner for the duration; yields the timers."""
    from freetoken import ops

    timers = _Timers()
    saved_dense, saved_att = ops.dense, ops.paged_attention
    runner = model.decoder.experts
    saved_run = runner.run
    ops.dense = timers.wrap("dense", saved_dense, _dense_shape)
    ops.paged_attention = timers.wrap("attention", saved_att)
    runner.run = timers.wrap("experts", saved_run)
    try:
        yield timers
    finally:
        ops.dense, ops.paged_attention = saved_dense, saved_att
        del runner.run


def split(model, prompt, steps: int, reps: int) -> dict:
    """{"prefill": {category: seconds}, "decode": {category: seconds per step}, "shapes_*": {...}} (medians)."""
    dec = model.decoder
    runs = []
    with instrumented(model) as timers:
        for rep in range(reps + 1):  # the first is the warm-up
            dec.reset()
            timers.reset()
            timers.active = True
            t0 = time.perf_counter()
            logits = dec.forward(np.asarray(prompt))
            pf_total = time.perf_counter() - t0
            pf, pf_shapes = dict(timers.totals), dict(timers.shapes)
            timers.reset()
            tok = int(logits[-1].argmax())
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = int(dec.forward(np.array([tok]))[-1].argmax())
            dc_total = time.perf_counter() - t0
            dc, dc_shapes = dict(timers.totals), dict(timers.shapes)
            timers.active = False
            if rep:
                pf["other"] = pf_total - sum(pf.values())
                dc["other"] = dc_total - sum(dc.values())
                pf["total"], dc["total"] = pf_total, dc_total
                runs.append((pf, dc, pf_shapes, dc_shapes))

    def med(i, key):
        return statistics.median(r[i].get(key, 0.0) for r in runs)

    keys = (*CATEGORIES, "total")
    return {"prefill": {k: med(0, k) for k in keys},
            "decode": {k: med(1, k) / steps for k in keys},
            "shapes_prefill": {s: med(2, s) for s in runs[0][2]},
            "shapes_decode": {s: med(3, s) / steps for s in runs[0][3]}}


def format_split(name: str, res: dict, prompt_tokens: int) -> str:
    lines = [f"{name}: time split (ms; prefill of {prompt_tokens} tokens, decode per step)"]
    for phase in ("prefill", "decode"):
        d = res[phase]
        total = d["total"]
        parts = "  ".join(f"{k} {d[k] * 1e3:8.2f} ({100 * d[k] / total:4.1f}%)" for k in CATEGORIES)
        lines.append(f"  {phase:<8} total {total * 1e3:9.2f}  {parts}")
    for phase in ("prefill", "decode"):
        shapes = sorted(res[f"shapes_{phase}"].items(), key=lambda kv: -kv[1])
        lines.append(f"  dense {phase} by matrix: " + ", ".join(f"{s} {t * 1e3:.2f}" for s, t in shapes))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, nargs="+", help="GGUF files or HF directories")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)

    import numba

    from freetoken.engine.loading.load import load

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    prompt = np.random.default_rng(0).integers(2, 4096, args.prompt_tokens).tolist()
    for path in args.model:
        model = load(path, device="cpu", ctx=len(prompt) + args.decode_tokens + 8)
        res = split(model, prompt, args.decode_tokens, args.reps)
        print(format_split(path.name, res, len(prompt)), flush=True)
    layer = numba.threading_layer() if _launched() else "?"
    print(f"# {numba.get_num_threads()} Numba threads, threading layer {layer}")
    return 0


def _launched() -> bool:
    import numba

    try:
        numba.threading_layer()
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
