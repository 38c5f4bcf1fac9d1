"""``freetoken serve``: the model behind an OpenAI-compatible HTTP API, for coding agents and other clients."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

#: Requests generating at once unless --max-seqs says otherwise: a coding agent's main request with a side request
#: (a title, a summary) or a sub-agent beside it, or two people's agents, without one waiting for the other.
DEFAULT_MAX_SEQS = 4

SERVE_DESCRIPTION = """\
Serve a model over HTTP with the OpenAI and Anthropic APIs, for coding agents and any of their clients:

  GET  /v1/models            the one model served (--served-model-name)
  POST /v1/chat/completions  chat through the model's chat template (stream: server-sent events); tools,
                             tool_choice, response_format json_object/json_schema (constrained decoding)
  POST /v1/completions       plain text continuation
  POST /v1/messages          the Anthropic Messages API (+ /v1/messages/count_tokens), tool use included
  POST /v1/anchors           prefill a conversation (or a prompt) and anchor it; GET lists, DELETE /v1/anchors/ID
                             drops one; a chat request's "anchor": ID resumes from it
  GET  /                     a chat page (the page needs no key; its API calls do)
  GET  /health               503 while the model loads, 200 when it serves (needs no key)
  GET  /metrics              Prometheus metrics: tokens, speeds, time to first token, queue, KV use, expert cache

Up to --max-seqs requests (default 4) generate together, sharing every step (continuous batching); the rest wait,
first come first served; a client that disconnects leaves before the next step. The KV cache is reused from request
to request, so an agent's next turn prefills only its new tail; each chat request also anchors its KV state at its
message boundaries (verified when restored), so a conversation that goes back to an earlier turn resumes there
(--anchor-dir keeps anchors across restarts).
Point an OpenAI client at http://HOST:PORT/v1, an Anthropic one at http://HOST:PORT (any API key unless --api-key
is set).
"""


def add_serve_parser(sub) -> None:
    from freetoken.cli.args import add_model_args, count
    from freetoken.cli.policy import add_policy_args

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description=SERVE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the "
                        "network, with --api-key)")
    p.add_argument("--port", type=count(0), default=8080, help="TCP port (default 8080; 0: any free one)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
                        "$FREETOKEN_API_KEY; unset: no key)")
    p.add_argument("--served-model-name", default=None, metavar="NAME[,ALIAS...]",
                   help="the model id /v1/models lists and requests send (default: the model's file or folder "
                        "name, 'freetoken-default' for the bundled model); more names after commas are accepted "
                        "too, for an agent that sends its own (claude-sonnet-4-5, gpt-4o...)")
    p.add_argument("--anchor-dir", default=None, metavar="DIR",
                   help="write every anchor (the KV state at a message boundary, or of POST /v1/anchors) to a file "
                        "in DIR, and index DIR's anchor files at start, so that a restarted server still resumes "
                        "from them (each is checked before use: another model's, or a damaged file, is refused "
                        "and recomputed). Default: anchors live in memory only")
    add_model_args(p, 1024, "per request when the request does not say (max_tokens)")
    p.add_argument("--max-tokens-limit", type=count(1), default=None, metavar="N",
                   help="the most tokens one reply may have, whatever the request asks for (agents ask for "
                        "8,000-64,000); a request asking for more gets N and the reply's max_tokens_capped says so. "
                        "Default: what the context leaves after the prompt")
    p.add_argument("--max-seqs", type=count(1), default=DEFAULT_MAX_SEQS, metavar="N",
                   help="continuous batching: up to N requests generate at once, sharing every step (a layer's "
                        "experts are read once for all of them), the rest wait first come first served; a long "
                        "prompt runs in chunks beside the running streams; the KV pool makes room for N whole "
                        "contexts as far as memory allows (--kv-memory sets it outright). Default "
                        f"{DEFAULT_MAX_SEQS} (an agent's requests and a side request or sub-agent beside them); 1: "
                        "one request at a time, in order")
    p.add_argument("--step-tokens", type=count(1), default=None, metavar="N",
                   help="with --max-seqs > 1: tokens in one step, decode tokens first, then prompt chunks (default: "
                        "the prefill chunk the model's activations are sized for, at least --max-seqs)")
    add_policy_args(p)
    p.set_defaults(func=cmd_serve)


#: Tests: a JSON file with a list of replies the server gives, in order, instead of generating (each request takes
#: the next; the model still tokenizes the prompt), so that the parsing of replies is checked on exact text.
SCRIPT_ENV = "FREETOKEN_SERVE_SCRIPT"


def _script() -> list[str] | None:
    import json

    path = os.environ.get(SCRIPT_ENV)
    if not path:
        return None
    try:
        replies = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"${SCRIPT_ENV} {path}: {e}") from None
    if not isinstance(replies, list) or not all(isinstance(r, str) for r in replies):
        raise ValueError(f"${SCRIPT_ENV} {path}: expected a JSON list of strings")
    print(f"freetoken serve: {len(replies)} scripted replies from ${SCRIPT_ENV} (a test setting)", file=sys.stderr)
    return replies


def served_name(model_path: str | None) -> str:
    if model_path is None:
        return "freetoken-default"
    p = Path(model_path)
    return p.stem if p.suffix == ".gguf" else (p.resolve().name or str(p))


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from freetoken.cli.args import context_kwargs
    from freetoken.cli.policy import apply_pinning, policy_kwargs
    from freetoken.engine.loading.load import load
    from freetoken.serve.app import Defaults, create_app

    if args.port > 65535:
        raise ValueError(f"--port {args.port}: a TCP port is at most 65535")
    if args.step_tokens is not None and args.step_tokens < args.max_seqs:
        raise ValueError(f"--step-tokens {args.step_tokens} must hold one decode token of each of the --max-seqs "
                         f"{args.max_seqs} running requests")
    api_key = args.api_key if args.api_key is not None else os.environ.get("FREETOKEN_API_KEY") or None
    names = [n.strip() for n in (args.served_model_name or "").split(",") if n.strip()] or [served_name(args.model)]
    name = names[0]
    defaults = Defaults(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, repetition_penalty=args.repetition_penalty,
                        max_tokens_limit=args.max_tokens_limit)
    failure: list[BaseException] = []
    server: uvicorn.Server | None = None

    if args.pin_hot and not args.pin_trace:
        raise ValueError("--pin-hot needs --pin-trace FILE here: a server has no prompt to warm up on")
    pin_note: list[str] = []

    def load_model():
        model = load(args.model, device=args.device, progress=False, cache_slots=args.cache_slots,
                     kv_sequences=args.max_seqs, **policy_kwargs(args), **context_kwargs(args))
        pin_note.append(apply_pinning(model, args, None))  # before the worker owns the model
        model.use_anchor_dir(args.anchor_dir)  # the anchor store, at load: DIR's files indexed before a request
        return model

    def ready(model):
        kind = model.decoder.dev.kind
        print(f"[{kind}] {model.decoder.context_plan.why}", file=sys.stderr)
        for note in model.decoder.cfg.notes():
            print(f"[{kind}] {note}", file=sys.stderr)
        if pin_note and pin_note[0]:
            print(f"[{kind}] {pin_note[0]}", file=sys.stderr)
        url = f"http://{args.host}:{bound_port()}"
        print(f"[{kind}] serving {name!r} at {url}/v1" + (" (API key required)" if api_key else "")
              + f"; chat page {url}/", file=sys.stderr, flush=True)

    def load_failed(e: BaseException):
        failure.append(e)
        if server is not None:
            server.should_exit = True

    def bound_port() -> int:
        try:
            return server.servers[0].sockets[0].getsockname()[1]
        except (AttributeError, IndexError, TypeError):
            return args.port

    app = create_app(load_model, names, api_key=api_key, defaults=defaults, on_load_error=load_failed,
                     on_ready=ready, script=_script(), max_seqs=args.max_seqs, step_tokens=args.step_tokens)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    print(f"freetoken serve: loading {args.model or 'the bundled model'} ({name!r}); listening on "
          f"{args.host}:{args.port} meanwhile (GET /health: 503 until ready)", file=sys.stderr, flush=True)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down gracefully, then passes the signal on
        if not failure:
            print("freetoken serve: stopped", file=sys.stderr)
            return 0
    if failure:  # what the loader raised, as `run` would raise it (bad input: one line and exit code 2)
        raise failure[0]
    if not server.started:
        raise OSError(f"could not listen on {args.host}:{args.port} (in use, or not an address of this machine)")
    return 0
