"""A live `freetoken serve` in a subprocess on a free loopback port (the bundled model on the cpu device), for the
server's tests: ``Server(tmp)`` starts it and waits until /health says 200."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

KEY = "test-key-1234"
CTX = 512
MODEL = "freetoken-default"
STARTUP_SECONDS = 900  # a cold Numba cache compiles the cpu kernels on first load (minutes on 2 cores)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, *args: str, env: dict | None = None, ctx: int | None = CTX):
        """``ctx``: the ``--ctx`` given (None: none, so the server takes the model's own context)."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "serve.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "freetoken", "serve", "--device", "cpu", "--port", str(self.port),
             *(["--ctx", str(ctx)] if ctx is not None else []), "--api-key", KEY, "--max-tokens", "32", *args],
            stdout=subprocess.DEVNULL, stderr=self.log.open("w"),
            env={**os.environ, "FREETOKEN_API_KEY": "", **(env or {})})
        self.health: list[int] = []  # every /health status seen while starting
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.log.read_text()}")
            try:
                code = httpx.get(self.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            self.health.append(code)
            if code == 200:
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the server was not ready after {STARTUP_SECONDS} s: {self.log.read_text()}")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", KEY), max_retries=0, timeout=300,
                             **kw)

    def post(self, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers=headers, timeout=300, **kw)

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
        m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def running_server(tmp_path_factory, *args: str, env: dict | None = None, ctx: int | None = CTX):
    """The body of a module-scoped ``server`` fixture (``yield from running_server(tmp_path_factory)``): a live
    server (``args``: more ``serve`` flags; ``env``: more environment; ``ctx``: as :class:`Server` takes it),
    stopped with Ctrl-C after the module, which must exit with code 0."""
    s = Server(tmp_path_factory.mktemp("serve"), *args, env=env, ctx=ctx)
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.log.read_text()  # a clean shutdown on Ctrl-C


def kill_mid_stream(server: Server, script: str, marker: str) -> None:
    """Run the client ``script`` (it prints ``marker`` per streamed piece), SIGKILL it once it streams, and wait for
    the server to count the request cancelled; then no request is running."""
    cancelled = server.metric("freetoken_requests_cancelled_total")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == marker  # it is streaming
    finally:
        proc.kill()  # SIGKILL: the connection drops with no goodbye
        proc.wait()
    deadline = time.monotonic() + 30
    while server.metric("freetoken_requests_cancelled_total") == cancelled and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("freetoken_requests_cancelled_total") == cancelled + 1
    assert server.metric("freetoken_requests_running") == 0
