"""Long context on the cpu device, side by side with llama.cpp (llama-cpp-python) on the same GGUF: prefill tokens/s
at several prompt lengths and decode tokens/s at several context lengths.

The model is a synthetic Qwen3-MoE-shaped Q4_0 GGUF (``bench/make_synthetic_gguf.py``; by default 16 layers, hidden
1024, 64 experts top-8, 16 query / 4 kv heads of 64, written here with room for the longest context), or
``--model PATH``. Both engines get the same random prompt on ``--threads`` threads; freetoken computes the last
position's logits, llama.cpp every position's (llama-cpp-python reads them so; its LM head is ~2% of the
synthetic model's prefill work). llama.cpp runs with flash attention and an f16 KV cache (its defaults for a long
context), freetoken with its default bf16 paged KV cache and prefill chunk. Each prefill is timed once after a
warm-up on a short prompt (a 16k-token prefill takes minutes on two cores; the ratio is what matters, and it comes
from one run); decode at context C is the median step time of ``--decode-tokens`` greedy steps after a C-token
prefill (context 0: after a one-token prompt).

    python bench/bench_prefill.py                      # 512 / 4k / 16k prefill, decode at 0 / 4k / 16k
    python bench/bench_prefill.py --lengths 512,2048 --model /tmp/syn.gguf --no-llama
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


def _ints(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 0, got {text!r}")
    return out


class Freetoken:
    name = "freetoken"

    def __init__(self, path: Path, ctx: int):
        from freetoken.engine.loading.load import load

        self.model = load(path, device="cpu", ctx=ctx)
        self.dec = self.model.decoder

    def prefill(self, ids: list[int]) -> int:
        self.dec.reset()
        return int(self.dec.forward(np.asarray(ids), last_only=True)[-1].argmax())

    def step(self, tok: int) -> int:
        return int(self.dec.forward(np.array([tok]), last_only=True)[-1].argmax())


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: Path, ctx: int, threads: int):
        import llama_cpp

        kw = dict(n_ctx=ctx, n_batch=2048, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                  logits_all=True, verbose=False)  # (its scores array needs it; the LM head is ~2% of a prefill)
        try:
            self.llm = llama_cpp.Llama(str(path), flash_attn=True, **kw)
            self.flash = True
        except TypeError:  # an older binding without the flag
            self.llm = llama_cpp.Llama(str(path), **kw)
            self.flash = False

    def prefill(self, ids: list[int]) -> int:
        self.llm.reset()
        self.llm.eval(list(ids))
        return int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))

    def step(self, tok: int) -> int:
        self.llm.eval([tok])
        return int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))


def measure(engine, prompt: list[int], lengths: list[int], contexts: list[int], steps: int) -> dict:
    """{("prefill", L): tokens/s, ("decode", C): tokens/s} for one engine (a decode context that is also a prefill
    length decodes right after that timed prefill)."""
    out = {}
    engine.prefill(prompt[:64])  # warm-up: Numba compiles, buffers fill
    engine.step(1)
    for n in sorted(set(lengths) | {max(c, 1) for c in contexts}):
        t0 = time.perf_counter()
        tok = engine.prefill(prompt[:n])
        if n in lengths:
            out["prefill", n] = n / (time.perf_counter() - t0)
            print(f"  {engine.name}: prefill {n} tokens: {out['prefill', n]:.1f} tok/s", file=sys.stderr, flush=True)
        for i, c in enumerate(c for c in contexts if max(c, 1) == n):
            if i:  # a second context on the same prefill (0 and 1): decode from a fresh one
                tok = engine.prefill(prompt[:n])
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                tok = engine.step(tok)
                times.append(time.perf_counter() - t0)
            out["decode", c] = 1.0 / statistics.median(times)
            print(f"  {engine.name}: decode at context {c}: {out['decode', c]:.1f} tok/s", file=sys.stderr,
                  flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: write the synthetic model)")
    ap.add_argument("--lengths", type=_ints, default=[512, 4096, 16384],
                    help="prefill lengths (default 512,4096,16384)")
    ap.add_argument("--contexts", type=_ints, default=[0, 4096, 16384], help="decode contexts (default 0,4096,16384)")
    ap.add_argument("--decode-tokens", type=int, default=16, help="decode steps per context (median reported)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp even where it is installed")
    args = ap.parse_args(argv)

    import numba

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    longest = max(args.lengths + args.contexts) + args.decode_tokens + 16
    path = args.model
    if path is None:
        from make_synthetic_gguf import main as make_synthetic

        path = Path(tempfile.mkdtemp(prefix="ft-bench-prefill-")) / "synthetic-q4_0.gguf"
        make_synthetic([str(path), "--max-position", str(longest + 1024)])  # llama.cpp rounds its context up
    have_llama, why = not args.no_llama, "skipped (--no-llama)"
    if have_llama:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            have_llama, why = False, "not installed (bash scripts/setup --llama-cpp)"
    prompt = np.random.default_rng(0).integers(2, 4096, max(args.lengths + args.contexts + [64])).tolist()

    results = {"freetoken": measure(Freetoken(path, longest), prompt, args.lengths, args.contexts,
                                    args.decode_tokens)}
    flash = "-"
    if have_llama:
        llama = LlamaCpp(path, longest, args.threads)
        flash = "on" if llama.flash else "not offered by this binding"
        results["llama.cpp"] = measure(llama, prompt, args.lengths, args.contexts, args.decode_tokens)
        del llama
    peer = f"llama-cpp-python, flash attention {flash}" if have_llama else why
    print(f"# {path.name}; {args.threads} threads; llama.cpp: {peer}")
    header = f"{'measure':<22} {'freetoken':>10} {'llama.cpp':>10} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for key in [("prefill", n) for n in args.lengths] + [("decode", c) for c in args.contexts]:
        ft = results["freetoken"][key]
        label = f"prefill {key[1]}" if key[0] == "prefill" else f"decode at ctx {key[1]}"
        if have_llama:
            lc = results["llama.cpp"][key]
            print(f"{label:<22} {ft:10.1f} {lc:10.1f} {ft / lc:6.2f}")
        else:
            print(f"{label:<22} {ft:10.1f} {'-':>10} {'-':>6}")
    print("tokens/s; ratio = freetoken / llama.cpp (> 1: freetoken faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
