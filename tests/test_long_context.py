"""A 32k-token prompt through `freetoken run --prompt-file` on the cpu device, in a subprocess whose peak RSS is
measured: it must stay within the memory the paged KV cache and chunked prefill promise, i.e. no [T, T] score matrix
and no activations beyond one prefill chunk.

The bound: peak RSS(32k prompt) <= peak RSS(the same command on a 64-token prompt) + 1.5 x (KV pool bytes the
32k tokens fill + the activation bound of one prefill chunk, ``chunk x activation_bytes_per_token``) + 64 MiB of
allocator slack. The short run's peak carries what does not grow with the prompt: the interpreter, the compiled
kernels, the weights (measured after a first run has filled the kernel caches: compiling takes more memory than
running). The model is a one-layer synthetic Qwen3-MoE GGUF (bench/make_synthetic_gguf.py) that declares
a 33k context."""

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken.engine.loading.context import activation_bytes_per_token, default_prefill_chunk
from freetoken.models.kv import KV_BLOCK_TOKENS, kv_token_bytes

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 32768
SHAPE = ["--layers", "1", "--experts", "4", "--top-k", "2", "--hidden", "64", "--moe-inter", "32", "--heads", "2",
         "--kv-heads", "1", "--head-dim", "32", "--max-position", "33792"]
SLACK = 64 << 20


def _peak_rss_of(cmd: list[str]) -> tuple[int, str]:
    """(peak RSS in bytes, stdout + stderr) of ``cmd`` run by a fresh interpreter whose only child it is (so the
    children's peak is that command's alone)."""
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stdout.write(r.stdout + r.stderr); "
             "print('\\nPEAK_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, 'RC', r.returncode)")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "NUMBA_NUM_THREADS": os.environ.get("NUMBA_NUM_THREADS", "2")})
    assert out.returncode == 0, out.stderr
    last = out.stdout.rstrip().splitlines()[-1].split()
    assert last[0] == "PEAK_KB" and last[3] == "0", out.stdout[-3000:]
    return int(last[1]) * 1024, out.stdout


@pytest.mark.slow
def test_32k_prompt_on_cpu_stays_within_the_memory_bound(tmp_path):
    from tokenizers import Tokenizer

    from freetoken.engine.loading.load import DEFAULT_MODEL

    sys.path.insert(0, str(ROOT / "bench"))
    from make_synthetic_gguf import main as make_synthetic
    from make_synthetic_gguf import synthetic_config

    model = tmp_path / "long.gguf"
    assert make_synthetic([str(model), *SHAPE]) == 0
    cfg = synthetic_config(layers=1, experts=4, top_k=2, hidden=64, moe_inter=32, heads=2, kv_heads=1, head_dim=32,
                           max_position=33792)
    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    text = ""
    for src in sorted(Path(os.__file__).parent.glob("*.py")):  # the standard library: what the tokenizer knows
        text += src.read_text(errors="replace")
        if len(text) > 6 * PROMPT_TOKENS:
            break
    ids = tok.encode(text).ids
    assert len(ids) > PROMPT_TOKENS
    long_prompt = tok.decode(ids[:PROMPT_TOKENS])
    (tmp_path / "long.txt").write_text(long_prompt)
    (tmp_path / "short.txt").write_text(tok.decode(ids[:64]))
    n_long = len(tok.encode(long_prompt).ids)
    assert PROMPT_TOKENS - 64 <= n_long <= PROMPT_TOKENS + 64

    def run(prompt_file):
        return _peak_rss_of([sys.executable, "-m", "freetoken", "run", "--model", str(model), "--device", "cpu",
                             "--prompt-file", str(prompt_file), "--max-tokens", "4", "--temperature", "0",
                             "--ctx", "33792"])

    run(tmp_path / "short.txt")  # compiles what the kernel caches lack (LLVM's own peak is no part of the bound)
    base, _ = run(tmp_path / "short.txt")
    peak, report = run(tmp_path / "long.txt")
    print(report[-1500:])
    assert "context 33792 tokens" in report, report[-2000:]
    kv = -(-(n_long + 4) // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS * kv_token_bytes(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "bf16")
    activations = default_prefill_chunk(cfg) * activation_bytes_per_token(cfg)
    bound = base + 1.5 * (kv + activations) + SLACK
    mib = 1 << 20
    assert peak <= bound, (f"peak RSS {peak / mib:.0f} MiB over the bound {bound / mib:.0f} MiB: short-prompt run "
                           f"{base / mib:.0f} MiB + 1.5 x (KV {kv / mib:.1f} MiB + activations "
                           f"{activations / mib:.1f} MiB) + {SLACK / mib:.0f} MiB")
    # the measurement is real: the long run did hold more than the short one (its KV pages at least)
    assert peak > base, (peak, base)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0
