"""``freetoken chat``: an interactive conversation through the model's chat template.

Reads one user message per line from stdin (a ``> `` prompt only when stdin is a terminal), streams each reply to
stdout and a per-turn stats line to stderr. ``/reset`` starts the conversation over, ``/anchor`` and ``/rollback``
mark the conversation and return to a mark (its K/V rows restored, verified: :mod:`freetoken.engine.reuse.anchors`),
``/exit`` (or end of input) ends the session. The KV cache is reused from turn to turn: a turn prefills only what
the previous one did not run.
"""

from __future__ import annotations

import argparse
import sys

CHAT_DESCRIPTION = """\
Chat with a model through its chat template, one message per input line; the reply streams to stdout and the
turn's prefill/decode stats go to stderr. The KV cache carries over from turn to turn, so a turn prefills only
the new part of the conversation.

Commands (alone on a line):
  /reset            forget the conversation (the --system prompt stays)
  /anchor [NAME]    mark the conversation as it stands (default names a1, a2, ...): its K/V rows are kept
  /rollback [NAME]  return to a mark (default the latest): the messages after it are dropped and its K/V rows
                    restored after a checksum check, so the next message prefills nothing before it
  /anchors          list the marks
  /exit             end the session (so does end of input)
"""

COMMANDS = ("/reset", "/anchor", "/rollback", "/anchors", "/exit", "/quit", "/help")


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


def _turn_stats(model, st) -> str:
    return (f"[{model.decoder.dev.kind}] prefill {st.prompt_tokens} new tokens at {st.prefill_tps:.1f} tok/s, "
            f"{st.cached_tokens} cached tokens reused, generated {st.generated_tokens} tokens, "
            f"decode at {st.decode_tps:.1f} tok/s; context {model.decoder.length}/{model.decoder.ctx}")


def cmd_chat(args: argparse.Namespace) -> int:
    from freetoken.cli.args import check_text, context_kwargs
    from freetoken.cli.policy import policy_kwargs
    from freetoken.engine.decoding.sampling import SamplingParams
    from freetoken.engine.loading.load import load

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
    for note in model.decoder.cfg.notes():
        print(f"[{model.decoder.dev.kind}] {note}", file=sys.stderr)
    rc = _converse(model, args, sampling)
    _report_memory(model, args.verbose)
    return rc


def _report_memory(model, verbose: bool) -> None:
    from freetoken.engine.loading.memory_report import breakdown_line, memory_line, types_line

    kind = model.decoder.dev.kind
    print(f"[{kind}] {memory_line(model)}", file=sys.stderr)
    print(f"[{kind}] {types_line(model)}", file=sys.stderr)
    if model.experts.tier is not None:
        print(f"[{kind}] {model.experts.tier_report()}", file=sys.stderr)
    if verbose:
        print(f"[{kind}] {breakdown_line(model)}", file=sys.stderr)


def _converse(model, args: argparse.Namespace, sampling) -> int:
    """The session's loop: one user message a line until /exit or the end of input; the exit code."""
    from freetoken.cli.policy import apply_pinning
    from freetoken.engine.generation.chat import Chat

    apply_pinning(model, args, None)
    chat = Chat(model, system=args.system)
    if chat.uses_fallback:
        print("freetoken chat: warning: the model has no chat template; using ChatML "
              "(<|im_start|>role\\n...<|im_end|>\\n)", file=sys.stderr)
    interactive = sys.stdin.isatty()
    marks: dict[str, object] = {}  # /anchor names -> anchors, in the order made
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
            print("commands: /reset (forget the conversation), /anchor [NAME] (mark it), /rollback [NAME] (return "
                  "to a mark), /anchors (list them), /exit (end the session)", file=sys.stderr)
            continue
        word, _, name = command.partition(" ")
        if word in ("/anchor", "/rollback", "/anchors"):
            _anchor_command(chat, marks, word, name.strip())
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
        print(_turn_stats(model, reply.stats), file=sys.stderr)
        if model.decoder.length >= model.decoder.ctx:
            print("freetoken chat: warning: the context is full; /reset to go on", file=sys.stderr)


def _anchor_command(chat, marks: dict, word: str, name: str) -> None:
    """/anchor [NAME], /rollback [NAME], /anchors: a failure is one error line and the session goes on."""
    if word == "/anchors":
        for n, a in marks.items():
            print(f"  {n}: {a.length} tokens, {a.tier}, id {a.id[:16]}", file=sys.stderr)
        if not marks:
            print("(no anchors: /anchor makes one)", file=sys.stderr)
        return
    try:
        if word == "/anchor":
            name = name or f"a{len(marks) + 1}"
            marks[name] = chat.anchor(label=name)
            print(f"(anchor {name}: {marks[name].length} tokens of the conversation)", file=sys.stderr)
            return
        if not marks:
            raise ValueError("no anchor to roll back to: /anchor makes one")
        name = name or list(marks)[-1]
        if name not in marks:
            raise ValueError(f"no anchor named {name!r} (have: {', '.join(marks)})")
        chat.rollback(marks[name])
        print(f"(rolled back to {name}: {len(chat.messages)} messages, {marks[name].length} tokens restored)",
              file=sys.stderr)
    except ValueError as e:
        _error(str(e))


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
