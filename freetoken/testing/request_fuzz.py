"""Mutated requests against a live `freetoken serve`: the server must answer every one with a 2xx or a 4xx in the
API's shape, never a 5xx, never hang, and stay healthy.

The seeds are the bodies real clients send (the OpenAI chat and text completions with tools and streaming, the
Anthropic messages with system blocks, tool use and results, count_tokens, anchors); a mutation edits the JSON tree
(drops a key, changes a value's type, puts in a lone surrogate, a huge or negative number, a deep nest, an unknown
role) or the bytes (truncated, a byte flipped, bytes inserted), up to three edits per request. Every request is
reproducible from ``(seed, index)``. ``bench/fuzz_server.py`` runs thousands and prints the table;
``tests/test_serve.py`` runs a few hundred in CI.
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

#: (path, body) of what real clients send; generation kept to a few tokens so a run stays short
SEEDS: list[tuple[str, dict]] = [
    ("/v1/chat/completions", {
        "model": "freetoken-default", "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "system", "content": "You are a coding agent."},
                     {"role": "user", "content": [{"type": "text", "text": "Read main.py"}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "read_file", "arguments": "{\"path\": \"main.py\"}"}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "print('hi')"}],
        "tools": [{"type": "function", "function": {
            "name": "read_file", "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}],
        "tool_choice": "auto", "stop": ["\n\n"], "top_p": 0.9, "seed": 1}),
    ("/v1/chat/completions", {
        "model": "freetoken-default", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "def add(a, b):"}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "r", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}}}),
    ("/v1/completions", {"model": "freetoken-default", "prompt": "import os\n", "max_tokens": 3, "echo": False,
                         "stream": False, "temperature": 0.5, "top_k": 20}),
    ("/v1/messages", {
        "model": "freetoken-default", "max_tokens": 3,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "List the files"},
                     {"role": "assistant", "content": [
                         {"type": "text", "text": "Listing."},
                         {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"dir": "."}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py\nb.py"}]}],
        "tools": [{"name": "ls", "description": "List a directory",
                   "input_schema": {"type": "object", "properties": {"dir": {"type": "string"}}}}],
        "tool_choice": {"type": "auto"}, "stop_sequences": ["###"], "metadata": {"user_id": "u"}}),
    ("/v1/messages", {"model": "freetoken-default", "max_tokens": 3, "stream": True, "temperature": 0.2,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}),
    ("/v1/messages/count_tokens", {"model": "freetoken-default",
                                   "messages": [{"role": "user", "content": "count me"}], "system": "be brief"}),
    ("/v1/anchors", {"messages": [{"role": "user", "content": "def f():"}]}),
    # the Responses API as Codex CLI and the Agents SDK send it (shapes from tests/clients/captured/)
    ("/v1/responses", {
        "model": "freetoken-default", "max_output_tokens": 3, "stream": True, "store": False,
        "instructions": "You are a coding agent.", "tool_choice": "auto", "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k1",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": None, "encrypted_content": "e"},
            {"type": "function_call", "call_id": "call_1", "name": "exec_command",
             "arguments": "{\"cmd\": \"ls\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py"}],
        "tools": [{"type": "function", "name": "exec_command", "description": "Run a command", "strict": False,
                   "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                  "required": ["cmd"]}},
                  {"type": "custom", "name": "apply_patch", "description": "Patch files",
                   "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
                  {"type": "web_search", "external_web_access": True}]}),
    ("/v1/responses", {"model": "freetoken-default", "input": "def add(a, b):", "max_output_tokens": 3,
                       "temperature": 0, "text": {"format": {"type": "json_schema", "name": "r", "schema": {
                           "type": "object", "properties": {"x": {"type": "integer"}}}}}}),
]

#: Values a mutation puts in place of another
_ODD_VALUES = [None, True, False, 0, -1, 1 << 63, -(1 << 70), 1e308, -0.5, "", "x" * 5000, "\ud800", "a\udfffb",
               "\u0000", "\U0001f600", [], {}, [None], {"": None}, "user", "assistant", "system", "tool", "developer",
               "text", "tool_use", "function", "required", "none", {"type": "tool"}, {"type": "any"}]
#: Keys a mutation adds (real fields with odd values, and unknown ones)
_KEYS = ["role", "content", "type", "text", "name", "input", "tool_calls", "max_tokens", "stream", "tools", "n",
         "logprobs", "anchor", "suffix", "prompt", "messages", "system", "thinking", "instructions",
         "previous_response_id", "call_id", "arguments", "output", "x-unknown"]


def _paths(value, here=()):
    """Every (container, key) place in a JSON tree."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield value, k
            yield from _paths(v, here + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield value, i
            yield from _paths(v, here + (i,))


def _mutate_tree(body, rng: random.Random):
    places = list(_paths(body))
    if not places:
        return rng.choice(_ODD_VALUES)
    parent, key = rng.choice(places)
    op = rng.randrange(8)
    if op == 0 and isinstance(parent, dict):
        del parent[key]
    elif op == 1:
        parent[key] = copy.deepcopy(rng.choice(_ODD_VALUES))
    elif op == 2 and isinstance(parent, dict):
        parent[rng.choice(_KEYS)] = copy.deepcopy(rng.choice(_ODD_VALUES + [parent[key]]))
    elif op == 3:  # nest the value
        v = parent[key]
        for _ in range(rng.choice([1, 5, 50, 300])):
            v = [v] if rng.random() < 0.5 else {"k": v}
        parent[key] = v
    elif op == 4 and isinstance(parent, list):  # repeat an element
        parent.extend(copy.deepcopy(parent[key]) for _ in range(rng.choice([1, 3, 40])))
    elif op == 5 and isinstance(parent[key], str):  # a string edited
        s = parent[key]
        cut = rng.randrange(len(s) + 1)
        parent[key] = s[:cut] + rng.choice(["\ud800", "\\", "\"", "<tool_call>", "<|im_end|>", "\x00", "é" * 100])
    elif op == 6 and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
        parent[key] = rng.choice([-1, 0, 1 << 31, 1 << 62, 1e30, -1e-30, 2.5])
    else:
        parent[key] = copy.deepcopy(rng.choice(_ODD_VALUES))
    return body


def _mutate_bytes(raw: bytes, rng: random.Random) -> bytes:
    op = rng.randrange(4)
    if not raw:
        return b"{"
    i = rng.randrange(len(raw))
    if op == 0:
        return raw[:i]
    if op == 1:
        return raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:]
    if op == 2:
        return raw[:i] + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8))) + raw[i:]
    return raw[:i] + rng.choice([b"NaN", b"Infinity", b"\xff\xfe", b"\\ud800", b"[" * 400, b'"', b"}"]) + raw[i:]


def make_request(seed: int, index: int) -> tuple[str, bytes]:
    """The ``index``-th mutated request of run ``seed``: (path, body bytes)."""
    rng = random.Random(seed * 1_000_003 + index)
    path, body = SEEDS[rng.randrange(len(SEEDS))]
    body = copy.deepcopy(body)
    for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):  # some seeds unchanged (past the checks, into the engine)
        body = _mutate_tree(body, rng)
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # the fuzz is about requests, not long generations (capping is tested elsewhere)
    raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    if rng.random() < 0.2:
        raw = _mutate_bytes(raw, rng)
    return path, raw


@dataclass
class FuzzReport:
    statuses: Counter = field(default_factory=Counter)  # (path, status class) -> count
    failures: list[str] = field(default_factory=list)  # 5xx, hangs, bad error bodies, an unhealthy server
    seconds: float = 0.0

    def table(self) -> str:
        paths = sorted({p for p, _ in self.statuses})
        classes = ["2xx", "4xx", "5xx", "hang"]
        lines = ["| endpoint | " + " | ".join(classes) + " |", "|---|" + "---|" * len(classes)]
        for p in paths:
            lines.append(f"| {p} | " + " | ".join(str(self.statuses[p, c]) for c in classes) + " |")
        total = sum(self.statuses.values())
        lines.append(f"\n{total} requests in {self.seconds:.0f} s; {len(self.failures)} failures")
        return "\n".join(lines + [f"  {f}" for f in self.failures[:20]])


def run(base_url: str, n: int, seed: int = 0, start: int = 0, api_key: str | None = None,
        timeout: float = 60.0, health_every: int = 50, progress=None) -> FuzzReport:
    """Send requests ``start .. start + n - 1`` of run ``seed`` to the server at ``base_url``."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    report = FuzzReport()
    t0 = time.monotonic()
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout) as http:
        for index in range(start, start + n):
            path, raw = make_request(seed, index)
            where = f"seed {seed} index {index} {path}"
            try:
                r = http.post(path, content=raw)
            except httpx.TimeoutException:
                report.statuses[path, "hang"] += 1
                report.failures.append(f"{where}: no answer in {timeout:g} s")
                continue
            except httpx.TransportError as e:
                report.statuses[path, "5xx"] += 1
                report.failures.append(f"{where}: connection failed: {e!r}")
                continue
            klass = f"{r.status_code // 100}xx"
            report.statuses[path, klass] += 1
            if r.status_code >= 500:
                report.failures.append(f"{where}: {r.status_code} {r.text[:200]}")
            elif r.status_code >= 400 and not _api_error_body(path, r):
                report.failures.append(f"{where}: {r.status_code} without the API's error body: {r.text[:200]}")
            if (index - start + 1) % health_every == 0 or index == start + n - 1:
                h = http.get("/health")
                if h.status_code != 200:
                    report.failures.append(f"after {where}: /health {h.status_code}")
                if progress is not None:
                    progress(index - start + 1, report)
    report.seconds = time.monotonic() - t0
    return report


def _api_error_body(path: str, r) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and isinstance(body.get("error"), dict) and "message" in body["error"]
    return isinstance(body.get("error"), dict) and "message" in body["error"]
