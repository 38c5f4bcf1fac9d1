"""Recording stand-in for an OpenAI/Anthropic-compatible server.

Used to capture exactly what unmodified coding agents (OpenAI Codex CLI,
Claude Code) send, and to let them finish a run without a real model.

Every request is appended to a JSONL log as one object:
    {"ts", "method", "path", "query", "headers", "body"}
where ``body`` is the parsed JSON body when it is JSON, else
``body_text`` / ``body_b64``.

Answers:
  * HEAD/GET ``/`` (and ``/health``, ``/v1``)   -> 200
  * POST ``/v1/messages`` (Anthropic Messages)  -> message, SSE when
    ``"stream": true``
  * POST ``/v1/messages/count_tokens``          -> {"input_tokens": N}
  * POST ``/v1/responses`` (OpenAI Responses)   -> SSE event stream (or a
    JSON response object when ``stream`` is false)
  * POST ``/v1/chat/completions``               -> chat completion (SSE if
    streamed)
  * GET  ``/v1/models``                         -> a one-model list
  * anything else                               -> 404 JSON error

Scripted tool use: when the newest user text contains ``RUN_TOOL`` the
reply is a tool call that runs ``echo hello-from-tool`` (``--tool-command``
changes it; Claude Code: the ``Bash`` tool; Codex: whichever shell-like tool
the request offers, e.g. ``exec_command``). ``RUN_PATCH`` asks for a file
write instead (Claude Code: ``Write``; Codex: ``apply_patch``, freeform
``custom_tool_call`` or JSON function, whichever is offered). When the newest
input is a tool result the reply is ``done: <last line of the result>``, so
the agent's loop ends. ``--thinking`` prepends a thinking block (Messages) or
a reasoning item with ``encrypted_content`` (Responses) to every reply, so
the follow-up request shows how the client sends them back.

``--fault NAME`` (repeatable) and ``--skip-event TYPE`` make the server
misbehave on purpose, to find out what a client really requires.

Usage:
    python tests/clients/record_server.py --port 0 --log /tmp/req.jsonl \
        [--port-file /tmp/port]
The chosen port is printed as ``PORT=<n>`` on stdout (and written to
``--port-file``).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import itertools
import json
import sys
import threading
import time
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

TOOL_MARKER = "RUN_TOOL"
PATCH_MARKER = "RUN_PATCH"
PATCH_FILE = "hello.txt"
PATCH_TEXT = f"*** Begin Patch\n*** Add File: {PATCH_FILE}\n+hello from patch\n*** End Patch\n"
TOOL_COMMAND = "echo hello-from-tool"
REPLY_TEXT = "hi"

FAULTS = (
    "no_event_lines",  # SSE without `event:` lines (data only)
    "no_seq",  # Responses events without sequence_number
    "no_usage",  # no token usage anywhere
    "no_item_done",  # Responses: no response.output_item.done
    "no_completed",  # Responses: no response.completed / Messages: no message_stop
    "no_message_delta",  # Messages: no message_delta (no stop_reason)
    "minimal_completed",  # Responses: response.completed carries only {"id"}
    "json_for_stream",  # answer stream:true with a plain JSON body
    "root_404",  # HEAD / and GET / answer 404
    "slow",  # sleep --slow-seconds before answering a model request
    "slow_stream",  # send headers + first event, then sleep --slow-seconds mid-stream
    "status_400",
    "status_401",
    "status_404",
    "status_429",
    "status_500",
    "status_503",
    "status_529",
)

_log_lock = threading.Lock()
_ids = itertools.count(1)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{next(_ids):04d}{uuid.uuid4().hex[:12]}"


# --------------------------------------------------------------------------
# Helpers to look at request bodies
# --------------------------------------------------------------------------


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    out = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    out.append(part["text"])
                elif "content" in part:
                    out.append(_text_of(part["content"]))
    return "\n".join(out)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:80] if lines else ""


def _anthropic_last_turn(body: dict):
    """Return ("tool_result", text) or ("user", text) for the newest user turn."""
    msgs = body.get("messages") or []
    for msg in reversed(msgs):
        if not isinstance(msg, dict) or msg.get("role") != "user":
            continue
        content = msg.get("content")
        if isinstance(content, list):
            results = [p for p in content if isinstance(p, dict) and p.get("type") == "tool_result"]
            if results:
                return "tool_result", _text_of(results[-1].get("content"))
        return "user", _text_of(content)
    return "user", ""


def _responses_last_turn(body: dict):
    items = body.get("input")
    if isinstance(items, str):
        return "user", items
    for item in reversed(items or []):
        if not isinstance(item, dict):
            continue
        typ = item.get("type")
        if typ in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            out = item.get("output")
            if isinstance(out, dict):
                out = out.get("content") or json.dumps(out)
            return "tool_result", _text_of(out) if not isinstance(out, str) else out
        if item.get("role") == "user":
            return "user", _text_of(item.get("content"))
    return "user", ""


def _tool_names(body: dict):
    names = {}
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        name = tool.get("name") or (tool.get("function") or {}).get("name") or tool.get("type")
        names[name] = tool
    return names


# --------------------------------------------------------------------------
# Handler
# --------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "record-server/1"
    log_path = None  # set by main()
    quiet = False
    faults: frozenset = frozenset()  # --fault names, to probe what clients require
    slow_seconds = 30.0
    thinking = False  # --thinking: prepend a thinking block / reasoning item to every reply
    skip_events: frozenset = frozenset()  # --skip-event names (Responses API events not to send)

    # -- plumbing ---------------------------------------------------------

    def handle_one_request(self):
        try:
            super().handle_one_request()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # client gave up (timeout/retry); nothing to answer

    def log_message(self, fmt, *args):  # noqa: D401 - keep stderr readable
        if not self.quiet:
            sys.stderr.write("[record] " + (fmt % args) + "\n")

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                line = self.rfile.readline().strip()
                size = int(line.split(b";")[0] or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            raw = b"".join(chunks)
        else:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
        enc = self.headers.get("Content-Encoding", "").lower()
        try:
            if enc == "gzip":
                raw = gzip.decompress(raw)
            elif enc == "deflate":
                raw = zlib.decompress(raw)
        except Exception:  # keep raw bytes; they are logged as base64
            pass
        return raw

    def _record(self, raw: bytes):
        parts = urlsplit(self.path)
        entry = {
            "ts": time.time(),
            "method": self.command,
            "path": parts.path,
            "query": {k: v if len(v) > 1 else v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()},
            "headers": {k: v for k, v in self.headers.items()},
        }
        body = None
        if raw:
            try:
                body = json.loads(raw)
                entry["body"] = body
            except Exception:
                try:
                    entry["body_text"] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    entry["body_b64"] = base64.b64encode(raw).decode()
        if self.log_path:
            with _log_lock, open(self.log_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry, ensure_ascii=False) + "\n")
        return parts.path, body

    def _send_json(self, status: int, obj, extra_headers=None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _start_sse(self, extra_headers=None):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        self.end_headers()

    def _chunk(self, data: bytes):
        if data:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

    def _end_sse(self):
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _sse(self, event: str | None, obj):
        head = f"event: {event}\n" if event and "no_event_lines" not in self.faults else ""
        payload = obj if isinstance(obj, str) else json.dumps(obj)
        self._chunk(f"{head}data: {payload}\n\n".encode())

    def _not_found(self):
        msg = f"no route for {self.command} {self.path}"
        self._send_json(404, {"error": {"type": "not_found_error", "message": msg}})

    # -- verbs ------------------------------------------------------------

    def do_HEAD(self):
        self._record(b"")
        path = urlsplit(self.path).path
        if path in ("/", "/health", "/v1", "/v1/") and "root_404" not in self.faults:
            self._send_json(200, {"ok": True})
        else:
            self._not_found()

    def do_GET(self):
        path, _ = self._record(b"")
        if path in ("/", "/health", "/v1", "/v1/") and "root_404" not in self.faults:
            self._send_json(200, {"ok": True})
        elif path.rstrip("/") in ("/v1/models", "/models"):
            self._send_json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": "test-model",
                            "object": "model",
                            "created": 0,
                            "owned_by": "record-server",
                            "type": "model",
                            "display_name": "test-model",
                            "created_at": "2024-01-01T00:00:00Z",
                        }
                    ],
                    "has_more": False,
                    "first_id": "test-model",
                    "last_id": "test-model",
                },
            )
        else:
            self._not_found()

    def do_DELETE(self):
        self._record(self._read_body())
        self._not_found()

    def do_PUT(self):
        self._record(self._read_body())
        self._not_found()

    def do_POST(self):
        raw = self._read_body()
        path, body = self._record(raw)
        if not isinstance(body, dict):
            self._send_json(400, {"error": {"type": "invalid_request_error", "message": "body must be a JSON object"}})
            return
        p = path.rstrip("/")
        for code in (400, 401, 404, 429, 500, 503, 529):
            if f"status_{code}" in self.faults and p.endswith(("/messages", "/responses", "/completions")):
                self._send_json(
                    code,
                    {"type": "error", "error": {"type": "api_error", "code": str(code), "message": f"injected {code}"}},
                )
                return
        if "slow" in self.faults:
            time.sleep(float(self.slow_seconds))
        if p in ("/v1/messages", "/messages"):
            self._anthropic(body)
        elif p in ("/v1/messages/count_tokens", "/messages/count_tokens"):
            self._send_json(200, {"input_tokens": max(1, len(json.dumps(body)) // 4)})
        elif p in ("/v1/responses", "/responses"):
            self._responses(body)
        elif p in ("/v1/chat/completions", "/chat/completions"):
            self._chat(body)
        else:
            self._not_found()

    # -- Anthropic Messages ----------------------------------------------

    def _anthropic(self, body: dict):
        model = body.get("model") or "test-model"
        kind, text = _anthropic_last_turn(body)
        tools = _tool_names(body)
        blocks = []
        if self.thinking:
            blocks.append(
                {
                    "type": "thinking",
                    "thinking": "Thinking about the reply.",
                    "signature": "c2lnbmF0dXJlLWZvci10ZXN0cw==",
                }
            )
        if kind == "tool_result":
            blocks.append({"type": "text", "text": f"done: {_last_line(text)}"})
            stop = "end_turn"
        elif PATCH_MARKER in text and "Write" in tools:
            blocks.append(
                {
                    "type": "tool_use",
                    "id": _new_id("toolu"),
                    "name": "Write",
                    "input": {"file_path": PATCH_FILE, "content": "hello from patch\n"},
                }
            )
            stop = "tool_use"
        elif TOOL_MARKER in text and "Bash" in tools:
            blocks.append(
                {
                    "type": "tool_use",
                    "id": _new_id("toolu"),
                    "name": "Bash",
                    "input": {"command": TOOL_COMMAND, "description": "Print a greeting"},
                }
            )
            stop = "tool_use"
        else:
            blocks.append({"type": "text", "text": REPLY_TEXT})
            stop = "end_turn"
        msg_id = _new_id("msg")
        usage = {"input_tokens": 10, "output_tokens": 2, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        headers = {"request-id": _new_id("req"), "anthropic-organization-id": "00000000-0000-0000-0000-000000000000"}
        if "no_usage" in self.faults:
            usage = {}
        if not body.get("stream") or "json_for_stream" in self.faults:
            self._send_json(
                200,
                {
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": blocks,
                    "stop_reason": stop,
                    "stop_sequence": None,
                    "usage": usage,
                },
                headers,
            )
            return
        self._start_sse(headers)
        self._sse(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {**usage, "output_tokens": 1},
                },
            },
        )
        if "slow_stream" in self.faults:
            time.sleep(float(self.slow_seconds))
        for i, block in enumerate(blocks):
            if block["type"] == "thinking":
                self._sse(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": i,
                        "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                    },
                )
                self._sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "thinking_delta", "thinking": block["thinking"]},
                    },
                )
                self._sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "signature_delta", "signature": block["signature"]},
                    },
                )
            elif block["type"] == "text":
                self._sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}},
                )
                self._sse(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": block["text"]}},
                )
            else:
                self._sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": i, "content_block": {**block, "input": {}}},
                )
                self._sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
                    },
                )
            self._sse("content_block_stop", {"type": "content_block_stop", "index": i})
        if "no_message_delta" not in self.faults:
            self._sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": {"output_tokens": 2},
                },
            )
        if "no_completed" not in self.faults:
            self._sse("message_stop", {"type": "message_stop"})
        self._end_sse()

    # -- OpenAI Responses --------------------------------------------------

    def _responses_tool_call(self, tools: dict):
        """A tool-call output item for whichever shell-like tool is offered."""
        call_id = _new_id("call")
        if "exec_command" in tools:
            return {
                "type": "function_call",
                "id": _new_id("fc"),
                "call_id": call_id,
                "name": "exec_command",
                "arguments": json.dumps({"cmd": TOOL_COMMAND}),
                "status": "completed",
            }
        if "shell_command" in tools:
            return {
                "type": "function_call",
                "id": _new_id("fc"),
                "call_id": call_id,
                "name": "shell_command",
                "arguments": json.dumps({"command": TOOL_COMMAND}),
                "status": "completed",
            }
        if "shell" in tools:
            return {
                "type": "function_call",
                "id": _new_id("fc"),
                "call_id": call_id,
                "name": "shell",
                "arguments": json.dumps({"command": ["bash", "-lc", TOOL_COMMAND]}),
                "status": "completed",
            }
        if "local_shell" in tools:
            return {
                "type": "local_shell_call",
                "id": _new_id("lsh"),
                "call_id": call_id,
                "status": "completed",
                "action": {"type": "exec", "command": ["bash", "-lc", TOOL_COMMAND]},
            }
        return None

    def _responses_patch_call(self, tools: dict):
        """apply_patch: freeform (custom tool) or JSON function, whichever is offered."""
        tool = tools.get("apply_patch")
        if not tool:
            return None
        if tool.get("type") == "custom":
            return {
                "type": "custom_tool_call",
                "id": _new_id("ctc"),
                "call_id": _new_id("call"),
                "name": "apply_patch",
                "input": PATCH_TEXT,
                "status": "completed",
            }
        return {
            "type": "function_call",
            "id": _new_id("fc"),
            "call_id": _new_id("call"),
            "name": "apply_patch",
            "arguments": json.dumps({"input": PATCH_TEXT}),
            "status": "completed",
        }

    def _responses(self, body: dict):
        model = body.get("model") or "test-model"
        kind, text = _responses_last_turn(body)
        tools = _tool_names(body)
        items = []
        if self.thinking:
            items.append(
                {
                    "type": "reasoning",
                    "id": _new_id("rs"),
                    "summary": [{"type": "summary_text", "text": "**Thinking** about the reply."}],
                    "encrypted_content": "ZW5jcnlwdGVkLXJlYXNvbmluZw==",
                }
            )
        call = None
        if kind == "user" and PATCH_MARKER in text:
            call = self._responses_patch_call(tools)
        elif kind == "user" and TOOL_MARKER in text:
            call = self._responses_tool_call(tools)
        if call is not None:
            items.append(call)
        else:
            reply = f"done: {_last_line(text)}" if kind == "tool_result" else REPLY_TEXT
            items.append(
                {
                    "type": "message",
                    "id": _new_id("msg"),
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": reply, "annotations": []}],
                }
            )
        resp_id = _new_id("resp")
        created = int(time.time())
        usage = {
            "input_tokens": 10,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 12,
        }
        base = {
            "id": resp_id,
            "object": "response",
            "created_at": created,
            "model": model,
            "status": "in_progress",
            "output": [],
            "usage": None,
        }
        done = {**base, "status": "completed", "output": items, "usage": usage}
        headers = {"x-request-id": _new_id("req")}
        if "no_usage" in self.faults:
            done["usage"] = None
        if not body.get("stream") or "json_for_stream" in self.faults:
            self._send_json(200, done, headers)
            return
        seq = itertools.count(0)
        self._start_sse(headers)

        def ev(name, **fields):
            if name in self.skip_events:
                return
            obj = {"type": name, **fields}
            if "no_seq" not in self.faults:
                obj["sequence_number"] = next(seq)
            self._sse(name, obj)

        ev("response.created", response=base)
        ev("response.in_progress", response=base)
        if "slow_stream" in self.faults:
            time.sleep(float(self.slow_seconds))
        for idx, item in enumerate(items):
            if item["type"] == "message":
                text_out = item["content"][0]["text"]
                ev(
                    "response.output_item.added",
                    output_index=idx,
                    item={**item, "status": "in_progress", "content": []},
                )
                ev(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
                ev("response.output_text.delta", item_id=item["id"], output_index=idx, content_index=0, delta=text_out)
                ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text_out)
                ev(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    part=item["content"][0],
                )
            elif item["type"] == "function_call":
                ev(
                    "response.output_item.added",
                    output_index=idx,
                    item={**item, "status": "in_progress", "arguments": ""},
                )
                ev(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=idx,
                    delta=item["arguments"],
                )
                ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=idx,
                    arguments=item["arguments"],
                )
            elif item["type"] == "custom_tool_call":
                ev("response.output_item.added", output_index=idx, item={**item, "input": "", "status": "in_progress"})
                ev("response.custom_tool_call_input.delta", item_id=item["id"], output_index=idx, delta=item["input"])
                ev("response.custom_tool_call_input.done", item_id=item["id"], output_index=idx, input=item["input"])
            elif item["type"] == "reasoning":
                summary = item["summary"][0]["text"]
                ev("response.output_item.added", output_index=idx, item={**item, "summary": []})
                ev(
                    "response.reasoning_summary_part.added",
                    item_id=item["id"],
                    output_index=idx,
                    summary_index=0,
                    part={"type": "summary_text", "text": ""},
                )
                ev(
                    "response.reasoning_summary_text.delta",
                    item_id=item["id"],
                    output_index=idx,
                    summary_index=0,
                    delta=summary,
                )
                ev(
                    "response.reasoning_summary_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    summary_index=0,
                    text=summary,
                )
                ev(
                    "response.reasoning_summary_part.done",
                    item_id=item["id"],
                    output_index=idx,
                    summary_index=0,
                    part=item["summary"][0],
                )
            else:
                ev("response.output_item.added", output_index=idx, item=item)
            if "no_item_done" not in self.faults:
                ev("response.output_item.done", output_index=idx, item=item)
        if "minimal_completed" in self.faults:
            done = {"id": resp_id}
        if "no_completed" not in self.faults:
            ev("response.completed", response=done)
        self._end_sse()

    # -- OpenAI Chat Completions (not used by the current agents) ----------

    def _chat(self, body: dict):
        model = body.get("model") or "test-model"
        cid = _new_id("chatcmpl")
        created = int(time.time())
        if not body.get("stream"):
            self._send_json(
                200,
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": REPLY_TEXT}}
                    ],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
                },
            )
            return
        self._start_sse()
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
        self._sse(
            None,
            {
                **base,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": REPLY_TEXT}, "finish_reason": None}],
            },
        )
        self._sse(None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        self._sse(None, "[DONE]")
        self._end_sse()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log", required=True, help="JSONL file to append requests to")
    ap.add_argument("--port-file", help="write the bound port here once listening")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument(
        "--fault",
        action="append",
        default=[],
        choices=FAULTS,
        help="misbehave on purpose (repeatable), to find what a client requires",
    )
    ap.add_argument(
        "--skip-event", action="append", default=[], help="Responses API event type not to send (repeatable)"
    )
    ap.add_argument(
        "--tool-command", default=TOOL_COMMAND, help="shell command the scripted tool call runs (default: %(default)s)"
    )
    ap.add_argument(
        "--thinking",
        action="store_true",
        help="prepend a thinking block (Messages) / reasoning item (Responses) to every reply",
    )
    ap.add_argument("--slow-seconds", type=float, default=30.0, help="delay for --fault slow")
    args = ap.parse_args(argv)
    Handler.log_path = args.log
    Handler.quiet = args.quiet
    Handler.faults = frozenset(args.fault)
    Handler.skip_events = frozenset(args.skip_event)
    Handler.slow_seconds = args.slow_seconds
    Handler.thinking = args.thinking
    globals()["TOOL_COMMAND"] = args.tool_command
    srv = ThreadingHTTPServer((args.host, args.port), Handler)
    srv.daemon_threads = True
    port = srv.server_address[1]
    print(f"PORT={port}", flush=True)
    if args.port_file:
        with open(args.port_file, "w") as fh:
            fh.write(str(port))
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()


if __name__ == "__main__":
    main()
