"""``freetoken chat``: an interactive conversation through the model's chat template.

Reads one user message per line from stdin (a ``> `` prompt only when stdin is a terminal), streams each reply to
stdout and a per-turn stats line to stderr. ``/reset`` starts the conversation over, ``/exit`` (or end of input)
ends the session. The KV cache is reused from turn to turn: a turn prefills only what the previous one did not run.
"""

from __future__ import annotations

import argparse
import sys

CHAT_DESCRIPTION = """\
Chat with a model through its chat template, one message per input line; the reply streams to stdout and the
turn's prefill/decode stats go to stderr. The KV cache carries over from turn to turn, so a turn prefills only
the new part of the conversation.

Commands (alone on a line):
  /reset   forget the conversation (the --system prompt stays)
  /exit    end the session (so does end of input)
"""

COMMANDS = ("/reset", "/exit", "/quit", "/help")


def _error(message: str) -> None:
    print(f"freetoken chat: error: {message}", file=sys.stderr)


def _read_line(interactive: bool) -> str | None:
    """The next input line without its newline; None at end of input. A line that is not valid UTF-8 is a
    ValueError (the session ends with one clear line, not a traceback)."""
    from freetoken.cli.args import check_text

    if interactive:
        try:
            return check_text(input("> "), "the input line")
        except EOFError:
            sys.stdout.write("\n")
            return None
    raw = sys.stdin.buffer.readline() if hasattr(sys.stdin, "buffer") else sys.stdin.readline().encode()
    if not raw:
        return None
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"an input line is not valid UTF-8 (byte {e.start} of the line)") from None
    return line.rstrip("\r\n")


def _turn_stats(model) -> str:
    st = model.stats
    return (f"[{model.decoder.dev.kind}] prefill {st.prompt_tokens} new tokens at {st.prefill_tps:.1f} tok/s, "
            f"{st.cached_tokens} cached tokens reused, generated {st.generated_tokens} tokens, "
            f"decode at {st.decode_tps:.1f} tok/s; context {model.decoder.length}/{model.decoder.ctx}")


def cmd_chat(args: argparse.Namespace) -> int:
    from freetoken.cli.args import check_text, context_kwargs
    from freetoken.cli.policy import policy_kwargs
    from freetoken.engine.load import load
    from freetoken.engine.sampling import SamplingParams

    # bad input fails here, before the model loads; freetoken.cli.main turns it into one line and exit code 2
    if args.system is not None:
        check_text(args.system, "--system")
    if args.pin_hot and not args.pin_trace:
        raise ValueError("freetoken chat needs --pin-trace FILE for --pin-hot (there is no prompt to warm up on)")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)
    model = load(args.model, device=args.device, progress=sys.stderr.isatty(), cache_slots=args.cache_slots,
                 **policy_kwargs(args), **context_kwargs(args))
    print(f"[{model.decoder.dev.kind}] {model.decoder.context_plan.why}", file=sys.stderr)
    rc = _converse(model, args, sampling)
    _report_memory(model, args.verbose)
    return rc


def _report_memory(model, verbose: bool) -> None:
    from freetoken.engine.memory_report import breakdown_line, memory_line

    kind = model.decoder.dev.kind
    print(f"[{kind}] {memory_line(model)}", file=sys.stderr)
    if verbose:
        print(f"[{kind}] {breakdown_line(model)}", file=sys.stderr)


def _converse(model, args: argparse.Namespace, sampling) -> int:
    """The session's loop: one user message a line until /exit or the end of input; the exit code."""
    from freetoken.cli.policy import apply_pinning
    from freetoken.engine.chat import Chat

    apply_pinning(model, args, None)
    chat = Chat(model, system=args.system)
    if chat.uses_fallback:
        print("freetoken chat: warning: the model has no chat template; using ChatML "
              "(<|im_start|>role\\n...<|im_end|>\\n)", file=sys.stderr)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = _read_line(interactive)
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            return 130
        if line is None:
            return 0
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            chat.reset()
            print("(conversation reset)", file=sys.stderr)
            continue
        if command == "/help":
            print("commands: /reset (forget the conversation), /exit (end the session)", file=sys.stderr)
            continue
        if command.startswith("/") and " " not in command and command[1:].isalpha():
            _error(f"unknown command {command} (commands: {', '.join(COMMANDS)})")
            continue
        reply = chat.send(line, args.max_tokens, sampling)
        try:
            for piece in reply:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            reply.close()  # the reply so far stays in the conversation
            sys.stdout.write("\n")
            print("(reply interrupted)", file=sys.stderr)
            continue
        except ValueError as e:
            _error(str(e))
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(_turn_stats(model), file=sys.stderr)
        if model.decoder.length >= model.decoder.ctx:
            print("freetoken chat: warning: the context is full; /reset to go on", file=sys.stderr)


def add_chat_parser(sub) -> argparse.ArgumentParser:
    """Register ``freetoken chat`` on the subparsers ``sub`` of the main parser."""
    from freetoken.cli.args import add_model_args

    p = sub.add_parser("chat", help="chat with a model through its chat template", description=CHAT_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, 256, "per reply")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    from freetoken.cli.policy import add_policy_args

    add_policy_args(p)
    p.set_defaults(func=cmd_chat)
    return p
