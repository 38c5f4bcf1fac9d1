"""`freetoken serve` under concurrent clients: aggregate output tok/s and time to first token, batched or one at a time.

For each ``--max-seqs`` value a server is started (cpu device by default) and, for each concurrency N in
``--streams``, N threads of the official ``openai`` client each stream one chat completion at once: a distinct
prompt of about ``--prompt`` tokens (no two share a prefix: each starts with its own number) and ``--output`` new
tokens (greedy). The table gives, per server and N: the aggregate output tok/s (all completion tokens over the wall
time from the first request sent to the last reply done), its ratio to the same server at one stream, and TTFT
p50 / p99 (request sent to first content chunk). ``--max-seqs 1`` is the one-request-at-a-time server, the
baseline measured in the same run.

    python bench/bench_serve.py                                   # bundled model, --max-seqs 1 and 16
    python bench/bench_serve.py --model /tmp/synthetic-moe.gguf --streams 1,4,8,16
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

KEY = "bench-key"
WORDS = ("value", "index", "result", "buffer", "count", "items", "offset", "length", "parser", "token", "window",
         "layer", "expert", "cache", "block", "stream")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, device: str, max_seqs: int, ctx: int, log: Path):
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "freetoken", "serve", "--device", device, "--port", str(port), "--ctx", str(ctx),
           "--api-key", KEY, "--max-seqs", str(max_seqs), "--max-tokens-limit", "100000"]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up in 15 minutes")


def prompt_text(i: int, tokens: int) -> str:
    rng = np.random.default_rng(i)
    body = " ".join(f"{WORDS[rng.integers(len(WORDS))]}_{rng.integers(100)} = {rng.integers(1000)}"
                    for _ in range(max(1, tokens // 6)))
    return f"# request {i}\n{body}\ndef f_{i}(x):"


def one_round(url: str, n: int, prompt: int, output: int, model_name: str, first_id: int) -> dict:
    import openai

    ttft, tokens, errors = [0.0] * n, [0] * n, []
    start = threading.Barrier(n + 1)

    def one(i):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=3600)
        start.wait()
        t0 = time.perf_counter()
        try:
            stream = client.chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": prompt_text(first_id + i, prompt)}],
                max_tokens=output, temperature=0, stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and not ttft[i]:
                    ttft[i] = time.perf_counter() - t0
                if chunk.usage is not None:
                    tokens[i] = chunk.usage.completion_tokens
        except Exception as e:  # noqa: BLE001 - reported in the table's run
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {errors[0]}")
    return dict(n=n, agg=sum(tokens) / wall, tokens=sum(tokens), ttft50=float(np.percentile(ttft, 50)),
                ttft99=float(np.percentile(ttft, 99)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-seqs", default="1,16", help="servers to compare, comma-separated --max-seqs values")
    ap.add_argument("--streams", default="1,2,4,8,16", help="concurrent clients, comma-separated")
    ap.add_argument("--prompt", type=int, default=200, help="about this many prompt tokens per request")
    ap.add_argument("--output", type=int, default=128, help="new tokens per request")
    ap.add_argument("--ctx", type=int, default=2048)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for max_seqs in (int(m) for m in args.max_seqs.split(",")):
            proc, url = start_server(args.model, args.device, max_seqs, args.ctx, Path(tmp) / f"serve-{max_seqs}.log")
            try:
                import httpx

                name = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
                one_round(url, 1, 16, 4, name, 10_000)  # warm-up
                first = 0
                for n in streams:
                    r = one_round(url, n, args.prompt, args.output, name, first)
                    first += n  # every request a prompt never seen before: no prefix reuse between rounds
                    rows.append((max_seqs, r))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    print(f"{args.model or 'bundled model'}, device {args.device}, {os.cpu_count()} CPUs "
          f"({platform.processor() or platform.machine()}), ~{args.prompt} prompt + {args.output} output tokens "
          "per request, greedy, streamed through the openai client")
    print("| --max-seqs | streams | aggregate tok/s | x same server at 1 stream | x --max-seqs 1 at this N | "
          "TTFT p50 s | TTFT p99 s |")
    print("|---|---|---|---|---|---|---|")
    base = {m: r["agg"] for m, r in rows if r["n"] == 1}
    serial = {r["n"]: r["agg"] for m, r in rows if m == 1}
    for m, r in rows:
        one = f"{r['agg'] / base[m]:.2f}" if m in base else "-"
        vs = f"{r['agg'] / serial[r['n']]:.2f}" if r["n"] in serial else "-"
        print(f"| {m} | {r['n']} | {r['agg']:.1f} | {one} | {vs} | {r['ttft50']:.2f} | {r['ttft99']:.2f} |")


if __name__ == "__main__":
    main()
