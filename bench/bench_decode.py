"""Decode and prefill tokens/s on the cpu device, side by side with llama.cpp (llama-cpp-python) on the same GGUF.

Models:
* ``default``: the bundled model from its HF directory (bf16 experts) and its Q4_0 GGUF export (written here by
  ``freetoken.convert``), so the GGUF row is the same file for both engines;
* ``synthetic``: a Qwen3-MoE-shaped Q4_0 GGUF (16 layers, 64 experts, top-8, hidden 1024; written by
  ``bench/make_synthetic_gguf.py`` unless --synthetic names an existing file), big enough (0.7 GB) that decode is
  bound by reading expert weights, as on real models.

Both engines run the same prompt (random ids), then greedy single-token decode steps, each on ``--threads``
threads; times are the median of ``--reps`` runs after a warm-up. llama.cpp computes logits for every prompt
token (logits_all, as freetoken's forward does). ``ratio`` is freetoken / llama.cpp (> 1: freetoken faster).
``roof`` is the decode step's expert bytes (top-k records per MoE layer) over this machine's read bandwidth,
measured in the same run: the best a bandwidth-bound decoder could do.

    python bench/bench_decode.py              # where llama-cpp-python is missing, its columns say so
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _freetoken_times(path, prompt, steps, reps):
    from freetoken.engine.load import load

    model = load(path, device="cpu", max_len=len(prompt) + steps + 8)
    dec = model.decoder

    def run():
        dec.reset()
        t0 = time.perf_counter()
        logits = dec.forward(np.asarray(prompt))
        t1 = time.perf_counter()
        tok = int(logits[-1].argmax())
        for _ in range(steps):
            tok = int(dec.forward(np.array([tok]))[-1].argmax())
        return t1 - t0, time.perf_counter() - t1

    run()  # warm-up: Numba compiles, caches fill
    times = [run() for _ in range(reps)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times), model


def _llama_times(path, prompt, steps, reps, threads):
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=len(prompt) + steps + 8, n_batch=len(prompt), n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)

    def run():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(list(prompt))
        t1 = time.perf_counter()
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        for _ in range(steps):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return t1 - t0, time.perf_counter() - t1

    run()
    times = [run() for _ in range(reps)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def _read_bandwidth() -> float:
    from bench_experts import ReadBandwidth

    return ReadBandwidth()(reps=5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", type=Path, default=None, help="existing synthetic GGUF (default: write one)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp even where it is installed")
    args = ap.parse_args(argv)

    import numba

    from freetoken.convert import export_gguf
    from freetoken.engine.load import DEFAULT_MODEL

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    try:
        import llama_cpp  # noqa: F401

        have_llama = not args.no_llama
        why = "" if have_llama else "skipped (--no-llama)"
    except ImportError:
        have_llama, why = False, "not installed (bash scripts/setup --llama-cpp)"

    tmp = Path(tempfile.mkdtemp(prefix="ft-bench-decode-"))
    default_gguf = export_gguf(DEFAULT_MODEL, tmp / "default-q4_0.gguf")
    synthetic = args.synthetic
    if synthetic is None:
        from make_synthetic_gguf import main as make_synthetic

        synthetic = tmp / "synthetic-q4_0.gguf"
        make_synthetic([str(synthetic)])
    rng = np.random.default_rng(0)
    prompt = rng.integers(2, 4096, args.prompt_tokens).tolist()
    bw = _read_bandwidth()
    print(f"# {args.threads} threads; prompt {args.prompt_tokens} tokens, {args.decode_tokens} decode steps, "
          f"median of {args.reps}; memory read bandwidth {bw:.1f} GB/s; llama.cpp: {why or 'llama-cpp-python'}")
    header = (f"{'model':<28} {'ft prefill':>10} {'llama pf':>9} {'ratio':>6} {'ft decode':>10} {'llama dec':>10} "
              f"{'ratio':>6} {'roof':>7}")
    print(header)
    print("-" * len(header))
    rows = [("default (HF, bf16 experts)", DEFAULT_MODEL, False), ("default (GGUF q4_0)", default_gguf, True),
            ("synthetic 16L/64E (q4_0)", synthetic, True)]
    for name, path, gguf in rows:
        pf, dc, model = _freetoken_times(path, prompt, args.decode_tokens, args.reps)
        cfg = model.config
        step_bytes = sum(cfg.moe_layers) * cfg.top_k * model.experts.layout.record_bytes
        roof = bw * 1e9 / step_bytes
        ft_pf, ft_dc = len(prompt) / pf, args.decode_tokens / dc
        if gguf and have_llama:
            lpf, ldc = _llama_times(path, prompt, args.decode_tokens, args.reps, args.threads)
            l_pf, l_dc = len(prompt) / lpf, args.decode_tokens / ldc
            cols = f"{l_pf:9.1f} {ft_pf / l_pf:6.2f} {ft_dc:10.1f} {l_dc:10.1f} {ft_dc / l_dc:6.2f}"
        else:
            cols = f"{'-':>9} {'-':>6} {ft_dc:10.1f} {'-':>10} {'-':>6}"
        print(f"{name:<28} {ft_pf:10.1f} {cols} {roof:7.0f}", flush=True)
    print("tokens/s; ratio = freetoken / llama.cpp; roof = read bandwidth / expert bytes per decode step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
