"""Continuous batching in the engine: aggregate decode speed and time to first token at N concurrent requests.

N requests of ``--prompt`` tokens each (distinct random token ids, so no two share a prefix, within a run or across
runs) and ``--output`` new
tokens (greedy, end-of-sequence ignored) are submitted at once to a
:class:`freetoken.engine.batching.step_loop.StepLoop` and run to the end. For each N the table gives the aggregate
output tokens per second (every request's tokens over the wall time of the whole run), its ratio to one request in the
same run, the per-request decode speed (tokens after the first over the time from its first to its last token), and
TTFT p50 / p99 (submission to first token). The engine alone, no HTTP: what the scheduler and ``forward_batch`` give.

``--llama-cpp`` (a GGUF model) runs llama.cpp's own batched decoding on the same file and threads in the same run,
as ``llama-batched-bench`` does it through llama-cpp-python's low-level API: one sequence id per stream, the prompts
prefilled together in batches of up to 512 tokens (logits of each prompt's last token only), then one
``llama_decode`` per step holding every stream's next token, greedy from the logits; its aggregate tok/s and TTFT
columns and freetoken / llama.cpp ratios are added.

    python bench/bench_batch.py                          # the bundled model, cpu
    python bench/make_synthetic_gguf.py /tmp/synthetic-moe.gguf
    python bench/bench_batch.py --model /tmp/synthetic-moe.gguf --streams 1,2,4,8,16 --llama-cpp
    python bench/bench_batch.py --model /tmp/synthetic-moe.gguf --streams 1,8,16 --profile   # where a step goes
    python bench/make_synthetic_gguf.py /tmp/synthetic-qwen35.gguf --arch qwen35moe --other q8_0
    python bench/bench_batch.py --model /tmp/synthetic-qwen35.gguf --streams 1,4,8 --linear-per-span   # the A/B
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time

import numpy as np


class StepProfile:
    """Where the steps' time goes (``--profile``; a synchronous device: cpu): each step's wall time split into the
    routed-expert layers (``MoeMLP``: router, shared expert, routed experts), the token mixers (attention or
    DeltaNet with their projections), the rest of the forward pass (embedding, norms, head) and the host work
    around it (scheduling, sampling); and the bytes of routed experts the steps read (each layer's union of routed
    experts x the record size), over the time in the expert layers. Kept for every step and, apart, for the steps
    that held decode tokens only (no prompt chunk: the batched decode step itself)."""

    def __init__(self, model):
        from freetoken.models import blocks
        from freetoken.models.decoder import MoeDecoder

        self.model, self.parts = model, {"experts": 0.0, "mixers": 0.0, "forward": 0.0, "step": 0.0}
        self.expert_bytes, self.steps = 0, 0
        self.decode = {"experts": 0.0, "mixers": 0.0, "forward": 0.0, "step": 0.0, "bytes": 0, "steps": 0,
                       "tokens": 0}
        self._before = dict(self.parts)
        self._patched = []
        for cls, part in ((blocks.MoeMLP, "experts"), (blocks.Attention, "mixers"), (blocks.LatentAttention, "mixers"),
                          (blocks.GatedDeltaNet, "mixers"), (MoeDecoder, "forward")):
            name = "__call__" if part != "forward" else "forward_batch"
            self._wrap(cls, name, part)

    def _wrap(self, cls, name: str, part: str) -> None:
        original = getattr(cls, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.parts[part] += time.perf_counter() - t0

        setattr(cls, name, timed)
        self._patched.append((cls, name, original))

    def after_step(self, seconds: float, decode_only: bool = False, tokens: int = 0) -> None:
        self.parts["step"] += seconds
        self.steps += 1
        experts = self.model.experts
        record = experts.layout.record_bytes if experts.layout is not None else 0
        read = sum(len(np.unique(self.model.decoder.dev.to_host(ids))) * record for ids in experts.last_routing)
        self.expert_bytes += read
        if decode_only:
            for k in ("experts", "mixers", "forward", "step"):
                self.decode[k] += self.parts[k] - self._before[k]
            self.decode["bytes"] += read
            self.decode["steps"] += 1
            self.decode["tokens"] += tokens
        self._before = dict(self.parts)

    def close(self) -> None:
        for cls, name, original in reversed(self._patched):
            setattr(cls, name, original)

    def row(self) -> dict:
        return self._row(self.parts, self.steps, self.expert_bytes)

    def decode_row(self) -> dict | None:
        """:meth:`row` over the decode-only steps (None: there was none), with their mean tokens."""
        d = self.decode
        if not d["steps"]:
            return None
        return dict(self._row(d, d["steps"], d["bytes"]), tokens=d["tokens"] / d["steps"])

    @staticmethod
    def _row(p: dict, steps: int, expert_bytes: int) -> dict:
        n = max(steps, 1)
        return dict(step_ms=p["step"] / n * 1e3, experts_ms=p["experts"] / n * 1e3, mixers_ms=p["mixers"] / n * 1e3,
                    rest_ms=(p["forward"] - p["experts"] - p["mixers"]) / n * 1e3,
                    host_ms=(p["step"] - p["forward"]) / n * 1e3,
                    expert_gbs=expert_bytes / max(p["experts"], 1e-9) / 1e9)


def run(model, n: int, prompt: int, output: int, max_seqs: int, step_tokens: int | None, seed: int,
        profile: bool = False) -> dict:
    from freetoken.engine.batching.step_loop import StepLoop
    from freetoken.engine.decoding.sampling import SamplingParams

    vocab = model.decoder.cfg.vocab_size
    rng = np.random.default_rng(seed)
    loop = StepLoop(model, max_seqs=max_seqs, step_tokens=step_tokens)
    greedy = SamplingParams(temperature=0.0)
    t0 = time.perf_counter()
    reqs = [loop.submit(rng.integers(3, vocab, prompt), output, greedy, stop_ids=()) for _ in range(n)]
    first, last = {}, {}
    prof = StepProfile(model) if profile else None
    while loop.has_work:
        t_step = time.perf_counter()
        steps_before, tokens_before = loop.stats.steps, loop.stats.tokens
        events = loop.step()
        now = time.perf_counter()
        if prof is not None and loop.stats.steps > steps_before:
            tokens = loop.stats.tokens - tokens_before
            decode_only = tokens == len(events) and all(ev.token is not None for ev in events)
            prof.after_step(now - t_step, decode_only, tokens)
        for ev in events:
            if ev.token is not None:
                first.setdefault(id(ev.request), now)
                last[id(ev.request)] = now
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.close()
    tokens = sum(len(r.output) for r in reqs)
    ttft = np.array([first[id(r)] - t0 for r in reqs])
    per = [(len(r.output) - 1) / (last[id(r)] - first[id(r)]) for r in reqs if last[id(r)] > first[id(r)]]
    return dict(n=n, tokens=tokens, wall=wall, agg=tokens / wall, per=float(np.mean(per)) if per else 0.0,
                ttft50=float(np.percentile(ttft, 50)), ttft99=float(np.percentile(ttft, 99)), steps=loop.steps,
                mean_step=loop.stats.tokens / max(loop.stats.steps, 1), profile=prof.row() if prof else None,
                decode_profile=prof.decode_row() if prof else None)


def run_llama(path: str, n: int, prompt: int, output: int, seed: int, threads: int, repack: bool) -> dict:
    """llama.cpp's batched decoding of ``n`` streams (see the module doc); the same measures as :func:`run`."""
    import llama_cpp as ll

    from freetoken.testing.oracles import llama_cpp_without_repacking

    lib = ll.llama_cpp
    with llama_cpp_without_repacking() if not repack else contextlib.nullcontext():
        model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    cp = lib.llama_context_default_params()
    chunk = 512
    cp.n_ctx = n * (prompt + output + 16)
    cp.n_batch = cp.n_ubatch = max(chunk, n)
    cp.n_seq_max = n
    cp.n_threads = cp.n_threads_batch = threads
    cp.kv_unified = True
    ctx = lib.llama_init_from_model(model, cp)
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = lib.llama_batch_init(cp.n_batch, 0, 1)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, prompt) for _ in range(n)]

    def decode(items):
        """One llama_decode of (sequence, position, token, wants logits) items; the logits rows asked for."""
        batch.n_tokens = len(items)
        for i, (s, pos, tok, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(tok), pos, 1
            batch.seq_id[i][0], batch.logits[i] = s, want
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return {s: int(np.argmax(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), shape=(vocab,))))
                for i, (s, _, _, want) in enumerate(items) if want}

    try:
        t0 = time.perf_counter()
        work = [(s, p, tok, p == prompt - 1) for s in range(n) for p, tok in enumerate(prompts[s])]
        nxt, first, last = {}, {}, {}
        for c in range(0, len(work), chunk):
            got = decode(work[c:c + chunk])
            now = time.perf_counter()
            for s, tok in got.items():
                nxt[s], first[s], last[s] = tok, now, now
        outputs = {s: [nxt[s]] for s in range(n)}
        for step in range(1, output):
            got = decode([(s, prompt + step - 1, outputs[s][-1], True) for s in range(n)])
            now = time.perf_counter()
            for s, tok in got.items():
                outputs[s].append(tok)
                last[s] = now
        wall = time.perf_counter() - t0
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    ttft = np.array([first[s] - t0 for s in range(n)])
    per = [(output - 1) / (last[s] - first[s]) for s in range(n) if last[s] > first[s]]
    return dict(agg=n * output / wall, per=float(np.mean(per)) if per else 0.0,
                ttft50=float(np.percentile(ttft, 50)), ttft99=float(np.percentile(ttft, 99)))


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
    ap.add_argument("--profile", action="store_true",
                    help="a second table: each step's time by part and the routed experts' read rate (cpu)")
    ap.add_argument("--llama-cpp", action="store_true", help="llama.cpp's batched decoding on the same GGUF, same run")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama.cpp without its weight repacking (llama-cpp-python 0.3.36 crashes on some AVX-512 "
                         "machines with repacked k-quants)")
    ap.add_argument("--linear-per-span", action="store_true",
                    help="run the Gated DeltaNet layers sequence by sequence, as before their batch ops (the A/B of "
                         "ops.short_conv_batch / ops.gated_delta_rule_batch on a hybrid model)")
    args = ap.parse_args()
    if args.linear_per_span:  # no StateBatch for a pass: GatedDeltaNet falls back to its per-span calls
        from freetoken import ops

        ops.StateBatch = lambda *a, **k: None
    if args.llama_cpp and not str(args.model or "").endswith(".gguf"):
        ap.error("--llama-cpp needs a GGUF --model (llama.cpp reads GGUF files only)")
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
    # warm-up: one stream and two at once (the batch kernels compile on their first call)
    # and a whole prompt first: every expert's pages touched before the first measured run
    run(model, 1, args.prompt, 4, max_seqs, args.step_tokens, args.seed + 10_000)
    for n in (1, min(2, max_seqs)):
        run(model, n, min(args.prompt, 16), 4, max_seqs, args.step_tokens, args.seed)
    # each run its own prompts (seed + 1 + its index): the prefix cache holds the earlier runs' rows, and prompts
    # repeated across runs would be reused instead of prefilled
    rows = [run(model, n, args.prompt, args.output, max_seqs, args.step_tokens, args.seed + 1 + i, args.profile)
            for i, n in enumerate(streams)]
    if args.llama_cpp:
        threads = int(os.environ.get("NUMBA_NUM_THREADS", os.cpu_count()))
        run_llama(args.model, 1, 16, 4, args.seed, threads, not args.llama_no_repack)  # warm-up
        for r in rows:
            r["llama"] = run_llama(args.model, r["n"], args.prompt, args.output, args.seed, threads,
                                   not args.llama_no_repack)
    base = rows[0]["agg"] if rows[0]["n"] == 1 else None
    name = args.model or "bundled model"
    print(f"{name}, device {args.device}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
          f"{args.prompt} prompt + {args.output} output tokens per request, max_seqs {max_seqs}, step tokens "
          f"{args.step_tokens or 'default'}")
    head = ("| streams | aggregate tok/s | x 1 stream | per-stream decode tok/s | TTFT p50 s | TTFT p99 s | steps | "
            "tokens/step |")
    if args.llama_cpp:
        head += " llama.cpp tok/s | x 1 stream | per-stream | TTFT p50 s | freetoken / llama.cpp |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    lbase = rows[0]["llama"]["agg"] if args.llama_cpp and rows[0]["n"] == 1 else None
    for r in rows:
        ratio = f"{r['agg'] / base:.2f}" if base else "-"
        line = (f"| {r['n']} | {r['agg']:.1f} | {ratio} | {r['per']:.1f} | {r['ttft50']:.2f} | {r['ttft99']:.2f} | "
                f"{r['steps']} | {r['mean_step']:.1f} |")
        if args.llama_cpp:
            lr = r["llama"]
            line += (f" {lr['agg']:.1f} | {lr['agg'] / lbase:.2f} |" if lbase else f" {lr['agg']:.1f} | - |")
            line += f" {lr['per']:.1f} | {lr['ttft50']:.2f} | {r['agg'] / lr['agg']:.2f} |"
        print(line)

    if args.profile:
        print("\nPer step (ms; a step: every running stream's token and prompt chunks), and the routed experts' read "
              "rate:")
        print("| streams | step | expert layers | token mixers | rest of the pass | host (schedule, sample) | "
              "expert GB/s |")
        print("|---" * 7 + "|")
        for r in rows:
            p = r["profile"]
            print(f"| {r['n']} | {p['step_ms']:.2f} | {p['experts_ms']:.2f} | {p['mixers_ms']:.2f} | "
                  f"{p['rest_ms']:.2f} | {p['host_ms']:.2f} | {p['expert_gbs']:.1f} |")
        print("\nThe decode-only steps (every running stream's token, no prompt chunk), ms per step:")
        print("| streams | tokens/step | steps | step | expert layers | token mixers | rest of the pass | host | "
              "expert GB/s |")
        print("|---" * 9 + "|")
        for r in rows:
            d = r["decode_profile"]
            if d is not None:
                print(f"| {r['n']} | {d['tokens']:.1f} | {r['steps']} | {d['step_ms']:.2f} | {d['experts_ms']:.2f} | "
                      f"{d['mixers_ms']:.2f} | {d['rest_ms']:.2f} | {d['host_ms']:.2f} | {d['expert_gbs']:.1f} |")


if __name__ == "__main__":
    main()
