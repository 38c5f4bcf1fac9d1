"""Decode and prefill tokens/s on the cpu device, side by side with llama.cpp (llama-cpp-python) on the same GGUF.

Models:
* ``default``: the bundled model from its HF directory (bf16 experts) and its Q4_0 GGUF export (written here by
  ``freetoken.convert``), so the GGUF row is the same file for both engines;
* ``synthetic``: Qwen3-MoE-shaped Q4_0 GGUFs (64 experts, top-8; non-expert matrices f16), big enough that decode
  is bound by reading expert weights, as on real models: by default two, written by ``bench/make_synthetic_gguf.py``
  (16 layers, hidden 1024, expert FFN 384: 0.7 GB; 8 layers, hidden 2048, expert FFN 768: 1.4 GB), and a
  Qwen3.5-MoE-shaped one (Gated DeltaNet and gated attention layers 3:1, 256 experts top-8, a shared expert, Q8_0
  dense matrices: 1.9 GB); ``--synthetic PATH`` (repeatable) names existing files instead.

Both engines run the same prompt (random ids), then greedy single-token decode steps, each on ``--threads`` threads;
times are the median of ``--reps`` runs after a warm-up, the two engines' runs alternated (a drift of the machine's
speed then hits both alike; ``pair range`` shows how far one pair's decode ratio strays from another's). llama.cpp
computes logits for every prompt token (logits_all, as freetoken's forward does). ``ratio`` is freetoken / llama.cpp
(> 1: freetoken faster). ``roof`` is this machine's read bandwidth (measured in the same run) over the bytes a decode
step reads (the top-k expert records of every MoE layer, the dense weights, Gated DeltaNet states read and written):
the best a bandwidth-bound decoder could do.

``--profile`` adds, per model, freetoken's time split of the prefill and of a decode step among routed experts,
dense projections, attention and the rest (:mod:`profile_split`, timed in a separate run).

    python bench/bench_decode.py              # where llama-cpp-python is missing, its columns say so
    python bench/bench_decode.py --synthetic /tmp/ftbench/syn16.gguf --synthetic /tmp/ftbench/syn8x2048.gguf --profile
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _freetoken_runner(path, prompt, steps):
    """(one timed run: (prefill seconds, decode seconds), the model), warmed up."""
    from freetoken.engine.loading.load import load

    model = load(path, device="cpu", ctx=len(prompt) + steps + 8)
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
    return run, model


def _llama_runner(path, prompt, steps, threads, repack: bool = True):
    import llama_cpp

    from freetoken.testing.oracles import llama_cpp_without_repacking

    # llama-cpp-python 0.3.36 crashes on AVX-512 machines with repacked k-quant weights
    with llama_cpp_without_repacking() if not repack else contextlib.nullcontext():
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
    return run


def _paired(ft_run, llama_run, reps):
    """Runs of the two engines alternated (ft, llama, ft, ...), so that a drift of the machine's speed (a VM shares
    its memory bandwidth with its neighbours) hits both alike: (ft times, llama times), lists of (prefill, decode)."""
    ft, ll = [], []
    for _ in range(reps):
        ft.append(ft_run())
        if llama_run is not None:
            ll.append(llama_run())
    return ft, ll


def _read_bandwidth() -> float:
    from bench_experts import ReadBandwidth

    return ReadBandwidth()(reps=5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", type=Path, action="append", default=None,
                    help="existing synthetic GGUF (repeatable; default: write the two default shapes)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp even where it is installed")
    ap.add_argument("--no-default", action="store_true", help="only the synthetic models")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama.cpp without its weight repacking (use_extra_bufts off): llama-cpp-python 0.3.36 "
                         "crashes on AVX-512 machines on repacked k-quant files (slower llama.cpp: say so with the "
                         "figures)")
    ap.add_argument("--profile", action="store_true",
                    help="also print freetoken's time split (experts / dense / attention / other) per model")
    args = ap.parse_args(argv)

    import numba

    from freetoken.convert import export_gguf
    from freetoken.engine.loading.load import DEFAULT_MODEL

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    try:
        import llama_cpp  # noqa: F401

        have_llama = not args.no_llama
        why = "" if have_llama else "skipped (--no-llama)"
    except ImportError:
        have_llama, why = False, "not installed (bash scripts/setup --llama-cpp)"

    tmp = Path(tempfile.mkdtemp(prefix="ft-bench-decode-"))
    rows = []
    if not args.no_default:
        default_gguf = export_gguf(DEFAULT_MODEL, tmp / "default-q4_0.gguf")
        rows += [("default (HF, bf16 experts)", DEFAULT_MODEL, False), ("default (GGUF q4_0)", default_gguf, True)]
    synthetic = args.synthetic
    if synthetic is None:
        from make_synthetic_gguf import main as make_synthetic

        synthetic = []
        for name, shape in SYNTHETIC_SHAPES.items():
            path = tmp / f"synthetic-{name}-q4_0.gguf"  # q4_0 experts
            make_synthetic([str(path), *shape])
            synthetic.append(path)
    rows += [(None, path, True) for path in synthetic]
    rng = np.random.default_rng(0)
    prompt = rng.integers(2, 4096, args.prompt_tokens).tolist()
    bw = _read_bandwidth()
    print(f"# {args.threads} threads; prompt {args.prompt_tokens} tokens, {args.decode_tokens} decode steps, "
          f"median of {args.reps}; memory read bandwidth {bw:.1f} GB/s; llama.cpp: {why or 'llama-cpp-python'}")
    header = (f"{'model':<32} {'ft prefill':>10} {'llama pf':>9} {'ratio':>6} {'ft decode':>10} {'llama dec':>10} "
              f"{'ratio':>6} {'pair range':>11} {'roof':>7}")
    print(header)
    print("-" * len(header))
    splits = []
    for name, path, gguf in rows:
        ft_run, model = _freetoken_runner(path, prompt, args.decode_tokens)
        llama_run = _llama_runner(path, prompt, args.decode_tokens, args.threads,
                                  not args.llama_no_repack) if gguf and have_llama else None
        ft, ll = _paired(ft_run, llama_run, args.reps)
        cfg = model.config
        kind = "qwen35 " if cfg.layer_types else ""
        name = name or (f"synthetic {kind}{cfg.num_layers}L/h{cfg.hidden}/{cfg.num_experts}E "
                        f"({model.experts.formats_name()})")
        # what one decode step must read: the top-k expert records of every MoE layer, the dense weights, and the
        # linear-attention states (read and written)
        dec = model.decoder
        step_bytes = (cfg.top_k * sum(lay.record_bytes for lay in model.experts.layouts)
                      + dec.weight_bytes()["dense weights"] + 2 * dec.state_bytes())
        roof = bw * 1e9 / step_bytes
        ft_pf = len(prompt) / statistics.median(t[0] for t in ft)
        ft_dc = args.decode_tokens / statistics.median(t[1] for t in ft)
        if ll:
            l_pf = len(prompt) / statistics.median(t[0] for t in ll)
            l_dc = args.decode_tokens / statistics.median(t[1] for t in ll)
            pair = sorted(b[1] / a[1] for a, b in zip(ft, ll, strict=True))  # per pair: decode speed ratio
            cols = (f"{l_pf:9.1f} {ft_pf / l_pf:6.2f} {ft_dc:10.1f} {l_dc:10.1f} {ft_dc / l_dc:6.2f} "
                    f"{pair[0]:5.2f}-{pair[-1]:<5.2f}")
        else:
            cols = f"{'-':>9} {'-':>6} {ft_dc:10.1f} {'-':>10} {'-':>6} {'-':>11}"
        print(f"{name:<32} {ft_pf:10.1f} {cols} {roof:7.0f}", flush=True)
        if args.profile:
            from profile_split import format_split, split

            splits.append(format_split(name, split(model, prompt, min(args.decode_tokens, 16), args.reps),
                                       len(prompt)))
        del model
    print("tokens/s (medians); ratio = freetoken / llama.cpp; pair range = the lowest and highest decode ratio of the "
          "runs taken in alternation; roof = read bandwidth / bytes a decode step reads (experts, dense weights, "
          "states)")
    for text in splits:
        print(text)
    return 0


#: The synthetic models written by default: make_synthetic_gguf arguments per name.
SYNTHETIC_SHAPES = {"16L-h1024": [], "8L-h2048": ["--layers", "8", "--hidden", "2048", "--moe-inter", "768"],
                    "qwen35-8L-h1024": ["--arch", "qwen35moe", "--other", "q8_0"]}



if __name__ == "__main__":
    sys.exit(main())
