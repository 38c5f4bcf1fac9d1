"""Continuous batching in the engine: aggregate decode speed and time to first token at N concurrent requests.

N requests of ``--prompt`` tokens each (distinct random token ids, so no two share a prefix) and ``--output`` new
tokens (greedy, end-of-sequence ignored) are submitted at once to a
:class:`freetoken.engine.batching.step_loop.StepLoop` and run to the end. For each N the table gives the aggregate
output tokens per second (every request's tokens over the wall time of the whole run), its ratio to one request in the
same run, the per-request decode speed (tokens after the first over the time from its first to its last token), and
TTFT p50 / p99 (submission to first token). The engine alone, no HTTP: what the scheduler and ``forward_batch`` give.

    python bench/bench_batch.py                          # the bundled model, cpu
    python bench/make_synthetic_gguf.py /tmp/synthetic-moe.gguf
    python bench/bench_batch.py --model /tmp/synthetic-moe.gguf --streams 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np


def run(model, n: int, prompt: int, output: int, max_seqs: int, step_tokens: int | None, seed: int) -> dict:
    from freetoken.engine.batching.step_loop import StepLoop
    from freetoken.engine.generation.sampling import SamplingParams

    vocab = model.decoder.cfg.vocab_size
    rng = np.random.default_rng(seed)
    loop = StepLoop(model, max_seqs=max_seqs, step_tokens=step_tokens)
    greedy = SamplingParams(temperature=0.0)
    t0 = time.perf_counter()
    reqs = [loop.submit(rng.integers(3, vocab, prompt), output, greedy, stop_ids=()) for _ in range(n)]
    first, last = {}, {}
    while loop.has_work:
        events = loop.step()
        now = time.perf_counter()
        for ev in events:
            if ev.token is not None:
                first.setdefault(id(ev.request), now)
                last[id(ev.request)] = now
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output) for r in reqs)
    ttft = np.array([first[id(r)] - t0 for r in reqs])
    per = [(len(r.output) - 1) / (last[id(r)] - first[id(r)]) for r in reqs if last[id(r)] > first[id(r)]]
    return dict(n=n, tokens=tokens, wall=wall, agg=tokens / wall, per=float(np.mean(per)) if per else 0.0,
                ttft50=float(np.percentile(ttft, 50)), ttft99=float(np.percentile(ttft, 99)), steps=loop.steps,
                mean_step=float(np.mean(loop.step_token_counts)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", default="1,2,4,8,16", help="concurrent requests, comma-separated")
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=128, help="new tokens per request")
    ap.add_argument("--max-seqs", type=int, default=None, help="running sequences at once (default: the most streams)")
    ap.add_argument("--step-tokens", type=int, default=None, help="tokens per step (default: the engine's)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    from freetoken.engine.loading.load import load
    from freetoken.models.kv import KVPool

    model = load(args.model, device=args.device, ctx=args.ctx)
    max_seqs = args.max_seqs or max(streams)
    dec, cfg = model.decoder, model.decoder.cfg
    # a pool with room for every running stream's tokens, so the numbers are not those of preemption
    blocks = max_seqs * (-(-(args.prompt + args.output) // dec.pool.block_size) + 1)
    if blocks > dec.pool.num_blocks:
        dec.set_context(KVPool(dec.dev, len(cfg.kv_layers), cfg.kv_cache_heads, cfg.kv_cache_dim, blocks,
                               kind=dec.pool.kind, values=cfg.kv_cache_values), dec.max_ctx, dec.prefill_chunk)
    run(model, 1, min(args.prompt, 16), 4, max_seqs, args.step_tokens, args.seed)  # warm-up
    rows = [run(model, n, args.prompt, args.output, max_seqs, args.step_tokens, args.seed) for n in streams]
    base = rows[0]["agg"] if rows[0]["n"] == 1 else None
    name = args.model or "bundled model"
    print(f"{name}, device {args.device}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
          f"{args.prompt} prompt + {args.output} output tokens per request, max_seqs {max_seqs}, step tokens "
          f"{args.step_tokens or 'default'}")
    print("| streams | aggregate tok/s | x 1 stream | per-stream decode tok/s | TTFT p50 s | TTFT p99 s | steps | "
          "tokens/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['agg'] / base:.2f}" if base else "-"
        print(f"| {r['n']} | {r['agg']:.1f} | {ratio} | {r['per']:.1f} | {r['ttft50']:.2f} | {r['ttft99']:.2f} | "
              f"{r['steps']} | {r['mean_step']:.1f} |")


if __name__ == "__main__":
    main()
