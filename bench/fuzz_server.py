"""Fuzz `freetoken serve`: N mutated requests (freetoken/testing/request_fuzz.py) against a live server with the
bundled model, and a table of answers per endpoint. The goal: 0 5xx, 0 hangs, every 4xx in the API's error shape,
/health 200 after every 50 requests and at the end.

    python bench/fuzz_server.py --n 10000
    python bench/fuzz_server.py --n 1 --start 4711        # one request again (its body is printed with -v)
    python bench/fuzz_server.py --url http://127.0.0.1:8080 --api-key K --n 500   # a server already running
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

from freetoken.testing import request_fuzz


def _start(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "freetoken", "serve", "--device", args.device, "--port", str(port),
                             "--ctx", str(args.ctx), "--api-key", "fuzz", "--max-tokens", "8"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"fuzz_server: the server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit("fuzz_server: the server was not ready in 900 s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000, help="requests to send (default 1000)")
    ap.add_argument("--seed", type=int, default=0, help="the run's seed: request i of a seed is always the same")
    ap.add_argument("--start", type=int, default=0, help="index of the first request")
    ap.add_argument("--url", default=None, help="a running server (default: start one with the bundled model)")
    ap.add_argument("--api-key", default=None, help="with --url: its key")
    ap.add_argument("--device", default="cpu", help="the started server's device (default cpu)")
    ap.add_argument("--ctx", type=int, default=2048, help="the started server's context (default 2048)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a request counts as a hang")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each request's body first")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n must be at least 1")
    if args.verbose:
        for i in range(args.start, args.start + args.n):
            path, raw = request_fuzz.make_request(args.seed, i)
            print(f"{i} {path} {raw[:2000]!r}")
    proc = None
    url, key = args.url, args.api_key
    if url is None:
        proc, url = _start(args)
        key = "fuzz"
    try:
        def progress(done, report):
            if done % 500 == 0:
                print(f"  {done}/{args.n} sent, {len(report.failures)} failures", file=sys.stderr, flush=True)

        report = request_fuzz.run(url, args.n, seed=args.seed, start=args.start, api_key=key, timeout=args.timeout,
                                  progress=progress)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(report.table())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
