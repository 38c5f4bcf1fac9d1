"""A scripted coding-agent session replayed three ways on the bundled model: how much prefill the radix prefix cache
and verified anchors save over no reuse and over single-sequence reuse (issue 14).

The session (deterministic for a ``--seed``; the same conversation in every mode, every assistant message scripted):

* a system prompt of about ``--system-tokens`` (3000) tokens: instructions and a JSON list of tool definitions
  (written into the system text: the templates here have no ``tools`` support), then the user's task;
* turn 0 asks for the first reply; each of ``--turns`` (12) turns is ``--calls-per-turn`` (1) tool calls in a row,
  one request each: the request appends the agent's reply (a scripted assistant message: one sentence and a
  ``<tool_call>`` JSON) and the tool's result (role ``tool``: source files read with line numbers, grep hits, test
  output, diffs, all cut from the Python standard library's sources so the tokenizer sees code), and asks for
  ``--max-tokens`` (16) greedy tokens (kind ``turn``). The results are drawn at ``--result-tokens`` (300-2000)
  tokens and kept at that size when the session fits the context; only when it would not (or would end past
  ``--target-tokens``) are they all scaled down by one factor so that the final prompt ends near the target, under
  the context (the factor is printed: about 0.23, 80-440 tokens, for the default session);
* on ``--retries`` (4) of the turns the agent then sends a side request with another system prompt (kind
  ``side``: "title this session", 300-400 tokens; ``--side-tokens N`` pads it with a source excerpt to about N
  tokens, a sub-agent with its own context), discards the turn's last tool call and its result, and sends the
  conversation from before that call again with another call and result (kind ``retry``), which the session keeps.

Context and KV pool: ``--ctx N`` (``freetoken.load(ctx=N)``; ``fit``: the session's longest request and its
generated tokens, rounded up to whole blocks, and one block more: a request that reuses a prefix ending in a partly
filled block the prefix cache shares copies that block before writing to it, one block beyond its own length, so in
a pool of exactly the context's blocks a request near the context fails with ``OutOfKVBlocks``) and ``--kv-memory
SIZE`` (``kv_memory=``, e.g. ``12MiB``; ``fit+N``: the longest request and N tokens more, in whole blocks); by
default the pool is what the context needs. A context beyond the bundled model's 32,768 trained positions loads (with
a warning); since every assistant message is scripted, what the model generates there does not matter: the prefill
counts, the times and the agreement between the modes do. The sizes ``fit`` needs come from the session, so the
model is loaded twice then (the session is built with the first, the runs use the second).

``--preset`` sets defaults (explicit flags override):

* ``default``: the session above, results scaled to end near 7700 tokens (the bundled model's context was 8192
  when these runs began; ``--target-tokens`` 7700 unless ``--ctx`` is given), the numbers of the earlier runs;
* ``spec``: 12 turns of one call, results at their drawn 300-2000 tokens, unscaled, a 3000-token system prompt,
  ``--ctx fit`` (about 16k tokens);
* ``agent``: 12 turns of 3 calls, results drawn at 100-600 tokens; that session (about 21k tokens) could not fit
  the former 8192 context even scaled (with every result at the 48-token floor it is still ~11.7k), so it is kept
  unscaled under ``--ctx fit``;
* ``pressure``: the default session in a KV pool only slightly above its longest request + 2000 tokens
  (``--kv-memory fit+2000``) with side requests of about 3000 tokens: a side request late in the session must evict
  the least recently used blocks (the prefix cache evicts unreferenced leaves; anchors hold their blocks against
  eviction up to their device budget and spill to host memory when the pool is short), so the retry after it can
  get its prefix back only from an anchor.

Rendered with ChatML by default (``--template model``: the bundled model's own template, which writes the message
contents only, without roles).

Modes, each from an empty KV pool (the decoder, prefix cache and anchors cleared in between; checked):

* ``none``: ``reuse_cache=False``, every prompt prefilled from scratch;
* ``single``: the reuse there was before the radix cache: only the decoder's own last sequence (the prefix cache
  is cleared before each request, so ``match`` finds just the sequence ``_retire`` puts back), no boundaries;
* ``radix``: ``reuse_cache=True`` with the radix prefix cache, and anchors made and restored at the message
  boundaries (``message_boundaries``).

Measured per request: prompt tokens, tokens prefilled and reused, time to first token (from the ``generate`` call
until it yields its first token: the reuse lookup, prefill, making anchors and the first sampling step), and in the
radix mode whether the prompt's start came from an anchor (the ``anchor`` column: the call's ``stats.anchor`` set, or
refused) and the seconds spent in ``AnchorStore.create`` / ``restore`` (timing wrappers on the store). The summary
gives totals per mode, the prefix cache's evictions, the anchors made / restored / refused, how often anchors
spilled to host memory and were read back, their tiers and the host bytes they hold at the end
(``AnchorStore.host_bytes_held``).

A request the pool cannot hold (``OutOfKVBlocks``) is counted and reported, its planned prefill counted (its whole
prompt when it failed before that, in the reuse lookup: an anchor read back from host memory), left out of the token
comparison, and the session goes on from a fresh sequence.

The "ideal" column is what an unbounded exact prefix cache would prefill (each prompt less its longest common
prefix with any earlier request's tokens): none / ideal is the most any reuse can save on this session, so a
radix mode that prefills the ideal and still misses a target misses it by the session's shape, not by the cache.

Targets: session prefilled tokens none / radix >= 10x; on retry requests, single / radix >= 3x. Greedy decoding
must give the same tokens in every mode; a mismatch is counted (not fatal) and the logits of the two modes
compared (max |difference| / max |logit| of the none mode's row, up to the first differing token).

    python bench/bench_agent.py                        # the default session, cpu
    python bench/bench_agent.py --preset spec --json /tmp/agent_spec.json
    python bench/bench_agent.py --preset pressure --json /tmp/agent_pressure.json
    python bench/bench_agent.py --turns 6 --retries 2 --target-tokens 5000 --json /tmp/agent.json
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

MODES = ("none", "single", "radix")
TARGETS = {"session none/radix": 10.0, "retry single/radix": 3.0}

# ---- the scripted session -------------------------------------------------------------------------------------------
SOURCES = ["json/decoder.py", "json/encoder.py", "json/scanner.py", "json/__init__.py", "textwrap.py", "difflib.py",
           "tokenize.py", "shlex.py", "csv.py", "configparser.py", "string.py", "argparse.py", "dataclasses.py",
           "functools.py", "heapq.py", "pathlib.py", "shutil.py", "tempfile.py", "inspect.py", "ast.py"]

TASK = ("The vendored JSON decoder (src/json/) reports the wrong line and column in the error message of an "
        "unterminated string when the document contains multi-byte characters, and `scanstring` accepts a control "
        "character after a backslash in strict mode. Find where the position is computed, fix both, add regression "
        "tests under tests/test_json_errors.py, and run the test suite. Keep the public API unchanged; do not touch "
        "the C accelerator.")

SYSTEM_INTRO = """You are an autonomous software engineering agent working in a git checkout of a Python project.
You solve the user's task by calling tools; the results come back in messages from the tool. Think briefly, then
call exactly one tool per reply, as a JSON object in <tool_call></tool_call> tags: {"name": ..., "arguments": {...}}.

Rules:
- Read the code before you change it. Prefer small, reviewable edits that keep the existing style.
- Never invent file contents: read them. Paths are relative to the repository root.
- Run the relevant tests after each change; when a test fails, read its output before editing again.
- Do not run commands that need the network, and do not modify files outside the repository.
- When the task is done, reply without a tool call: a short summary of what changed and why.

# Tools

The tools you can call, as JSON schema:
"""

SYSTEM_TOOLS = [
    ("read_file", "Read a text file of the repository. Returns the lines with their numbers (cat -n style). Long "
     "files are cut: ask for a line range to read further.",
     {"path": ("string", "the file, relative to the repository root"),
      "start_line": ("integer", "the first line to return (1-based, default 1)"),
      "end_line": ("integer", "the last line to return (default: as many as fit the output limit)")}),
    ("write_file", "Create or overwrite a file with the given content. Parent directories are created. Use "
     "edit_file for changes to an existing file.",
     {"path": ("string", "the file, relative to the repository root"),
      "content": ("string", "the complete new content of the file")}),
    ("edit_file", "Replace an exact, unique piece of text in a file by another. Fails when old_text is not found "
     "or found more than once; returns a unified diff of the change with context.",
     {"path": ("string", "the file, relative to the repository root"),
      "old_text": ("string", "the text to replace, exactly as in the file (whitespace included)"),
      "new_text": ("string", "the replacement text")}),
    ("grep", "Search files for a regular expression (ripgrep syntax). Returns path:line:text for each match, "
     "sorted by path; binary and ignored files are skipped.",
     {"pattern": ("string", "the regular expression"),
      "path": ("string", "a file or directory to search (default: the whole repository)"),
      "glob": ("string", "only files whose name matches this glob, e.g. *.py"),
      "context": ("integer", "lines of context around each match (default 0)")}),
    ("list_dir", "List a directory: names, sizes and types, directories first.",
     {"path": ("string", "the directory, relative to the repository root (default: the root)"),
      "depth": ("integer", "how many levels to descend (default 1)")}),
    ("run_tests", "Run the project's tests with pytest. Returns pytest's output: the summary and, for failures, "
     "their tracebacks.",
     {"path": ("string", "a test file, directory or node id (default: all tests)"),
      "keyword": ("string", "only tests matching this -k expression"),
      "verbose": ("boolean", "one line per test (default false)")}),
    ("run_shell", "Run a shell command in the repository root (bash, no network, 120 s limit). Returns its exit "
     "status, stdout and stderr. Do not use it to edit files.",
     {"command": ("string", "the command line"),
      "timeout": ("integer", "seconds before the command is killed (default 120)")}),
    ("git_diff", "Show the uncommitted changes of the working tree as a unified diff.",
     {"path": ("string", "limit the diff to this path"),
      "staged": ("boolean", "show the staged changes instead")}),
    ("python_eval", "Evaluate a short Python snippet in a fresh interpreter with the repository on sys.path; "
     "returns what it prints and the repr of the last expression.",
     {"code": ("string", "the Python source to run")}),
    ("find_symbol", "Find where a function, class or variable is defined and where it is used (static analysis "
     "over the repository's Python files).",
     {"name": ("string", "the symbol, optionally qualified: module.Class.method"),
      "kind": ("string", "definition, references or both (default both)")}),
]

SYSTEM_OUTRO = """
# Repository notes

The package under src/json/ is a pure-Python copy of the standard library's json module, kept in sync by hand.
Tests live in tests/ and use pytest; the fixtures are in tests/conftest.py. The style guide (excerpt) follows.
"""

SIDE_SYSTEM = ("You write titles for coding-agent sessions. Given the start of a session, reply with a title of "
               "three to seven words that says what the session is about. Reply with the title only: no quotes, no "
               "punctuation at the end, no explanation.")

# the agent's scripted calls: (tool, a sentence before the call); arguments and results are drawn per turn
PLAN = [("grep", "Let me find where the decoder builds its error positions."),
        ("read_file", "I'll read the decoder around the error handling."),
        ("read_file", "Now the string scanner, where unterminated strings are detected."),
        ("grep", "Let me see who calls the error constructor."),
        ("run_tests", "Before changing anything, I'll run the existing JSON tests."),
        ("read_file", "The failure points into the encoder; let me read it."),
        ("edit_file", "I'll fix the column computation to count characters, not bytes."),
        ("run_tests", "Running the tests again after the fix."),
        ("read_file", "Let me check the module's public entry points stay the same."),
        ("edit_file", "Now the strict-mode check for control characters after a backslash."),
        ("grep", "Checking for other places that compute line and column."),
        ("run_tests", "Running the whole suite one more time.")]
RETRY_INTRO = "That was not the right place; let me look elsewhere instead."


def _schema(tools) -> list[dict]:
    return [{"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object",
                       "properties": {k: {"type": t, "description": d} for k, (t, d) in params.items()},
                       "required": [next(iter(params))]}}} for name, desc, params in tools]


class Corpus:
    """Lines of stdlib source files, with token counts per line (cached), to cut tool results of a given size."""

    def __init__(self, encode, rng: np.random.Generator):
        root = Path(sysconfig.get_paths()["stdlib"])
        self.files = {}
        for rel in SOURCES:
            p = root / rel
            if p.is_file():
                self.files[f"src/{rel}"] = p.read_text(encoding="utf-8", errors="replace").splitlines()
        if len(self.files) < 4:
            raise SystemExit(f"too few standard-library sources found under {root}")
        self.encode, self.rng = encode, rng
        self._ntok: dict[str, int] = {}

    def ntok(self, line: str) -> int:
        n = self._ntok.get(line)
        if n is None:
            n = self._ntok[line] = len(self.encode(line + "\n"))
        return n

    def take(self, lines, n_tokens: int) -> list[str]:
        out, have = [], 0
        for line in lines:
            if have >= n_tokens:
                break
            out.append(line)
            have += self.ntok(line)
        return out

    def path(self) -> str:
        names = sorted(self.files)
        return names[int(self.rng.integers(len(names)))]

    def read_file(self, n):
        path = self.path()
        lines = self.files[path]
        start = int(self.rng.integers(0, max(1, len(lines) // 2)))
        body = self.take((f"{i + 1:6d}\t{line}" for i, line in enumerate(lines[start:], start)), n)
        return {"path": path, "start_line": start + 1}, "\n".join(body)

    def grep(self, n):
        word = ["def ", "return ", "self.", "raise ", "if not ", "for ", "import "][int(self.rng.integers(7))]
        names = sorted(self.files)
        first = int(self.rng.integers(len(names)))
        hits = (f"{p}:{i + 1}:{line}" for p in names[first:] + names[:first]
                for i, line in enumerate(self.files[p]) if word in line)
        return {"pattern": word.strip(), "path": "src/", "glob": "*.py"}, "\n".join(self.take(hits, n))

    def run_tests(self, n):
        path = self.path()
        lines = self.files[path]
        start = int(self.rng.integers(0, max(1, len(lines) - 40)))
        head = ["============================= test session starts ==============================",
                "platform linux -- Python 3.11.7, pytest-8.3.3, pluggy-1.5.0",
                "rootdir: /repo", "collected 148 items", "",
                "tests/test_json_errors.py ....F.....F...                                 [  9%]",
                "tests/test_decode.py ...............................................      [ 41%]",
                "tests/test_encode.py ...............................................      [ 73%]",
                "tests/test_scanner.py ........................................           [100%]", "",
                "=================================== FAILURES ===================================",
                "________________________ test_unterminated_string_column ________________________", ""]
        tb = (f"{path}:{i + 1}: in frame_{i}\n    {line.strip()}" if i % 7 == 0 else f"    {line}"
              for i, line in enumerate(lines[start:], start))
        tail = ["E       AssertionError: assert 17 == 14", "FAILED tests/test_json_errors.py::"
                "test_unterminated_string_column - AssertionError", "========================= 2 failed, 146 "
                "passed in 1.92s =========================="]
        return {"path": "tests/", "keyword": "json"}, "\n".join(head + self.take(tb, n) + tail)

    def edit_file(self, n):
        import difflib

        path = self.path()
        lines = self.files[path]
        start = int(self.rng.integers(0, max(1, len(lines) - 200)))
        old = self.take(lines[start:], n // 2)
        new = [line.replace("pos", "index") if "pos" in line else line for line in old]
        k = len(old) // 2
        new[k:k] = ["        # count characters, not bytes: the message reports a column",
                    "        col = index - doc.rfind('\\n', 0, index)"]
        diff = difflib.unified_diff(old, new, f"a/{path}", f"b/{path}", lineterm="", n=len(old))
        return {"path": path, "old_text": old[k], "new_text": new[k]}, "\n".join(self.take(diff, n))


def build_session(encode, render, args, scale: float, raw_sizes: np.ndarray):
    """The requests, in order: dicts of turn, call, kind, messages, ids. ``raw_sizes``: tool-result token sizes
    before ``scale`` (one per call, ``--turns`` x ``--calls-per-turn``, then one per retry)."""
    seed, turns, retries, k_calls = args.seed, args.turns, args.retries, args.calls_per_turn
    rng = np.random.default_rng(seed)
    corpus = Corpus(encode, rng)
    side_corpus = Corpus(encode, np.random.default_rng(seed + 2))  # the side requests' padding: its own draws
    system = SYSTEM_INTRO + json.dumps(_schema(SYSTEM_TOOLS), indent=2) + SYSTEM_OUTRO
    style = [line for p in sorted(corpus.files) for line in corpus.files[p] if line.strip().startswith("#")]
    have = len(encode(system))
    if have < args.system_tokens:
        system += "\n".join(corpus.take(style, args.system_tokens - have))
    retry_turns = sorted(rng.choice(np.arange(2, turns + 1), size=min(retries, max(turns - 1, 0)),
                                    replace=False).tolist()) if turns >= 2 else []
    sizes = [max(48, int(round(s * scale))) for s in raw_sizes]

    def call(tool, sentence, n):
        args, result = getattr(corpus, tool)(n)
        text = f"{sentence}\n<tool_call>\n{json.dumps({'name': tool, 'arguments': args})}\n</tool_call>"
        return {"role": "assistant", "content": text}, {"role": "tool", "content": result.strip("\n").rstrip()}

    def side_request(last_call):
        side = [{"role": "system", "content": SIDE_SYSTEM},
                {"role": "user", "content": f"<session>\n{TASK}\n{last_call}\n</session>"}]
        if args.side_tokens:  # a sub-agent with its own context: a source excerpt up to about --side-tokens
            base, user = len(encode(render(side))), side[1]["content"]
            if base < args.side_tokens:
                where = side_corpus.read_file(0)[0]  # a file and a start line, drawn once
                lines = side_corpus.files[where["path"]][where["start_line"] - 1:]
                lines = [f"{i:6d}\t{line}" for i, line in enumerate(lines, where["start_line"])]
                n = args.side_tokens - base
                for _ in range(3):  # lines counted alone tokenize a little differently in context: correct twice
                    side[1]["content"] = "<context>\n" + "\n".join(side_corpus.take(lines, n)) + "\n</context>\n" + user
                    n += args.side_tokens - len(encode(render(side)))
        return side

    msgs = [{"role": "system", "content": system.strip()}, {"role": "user", "content": TASK}]
    out = [{"turn": 0, "call": 0, "kind": "turn", "messages": list(msgs)}]
    n_retry = 0
    for t in range(1, turns + 1):
        for c in range(k_calls):
            j = (t - 1) * k_calls + c
            tool, sentence = PLAN[j % len(PLAN)]
            msgs += call(tool, sentence, sizes[j])
            out.append({"turn": t, "call": c, "kind": "turn", "messages": list(msgs)})
        if t in retry_turns:
            out.append({"turn": t, "call": k_calls - 1, "kind": "side", "messages": side_request(msgs[-2]["content"])})
            alt = PLAN[(j + 3) % len(PLAN)][0]
            msgs = msgs[:-2]  # back to before the turn's last call
            msgs += call(alt, RETRY_INTRO, sizes[turns * k_calls + n_retry])
            n_retry += 1
            out.append({"turn": t, "call": k_calls - 1, "kind": "retry", "messages": list(msgs)})
    for r in out:
        r["ids"] = encode(render(r["messages"]))
    return out, retry_turns, sizes[:turns * k_calls + n_retry]


def fit_session(encode, render, args, ctx: int | None):
    """The session, its tool results at their drawn sizes unless the session would not fit: then all scaled down
    by one factor so that the final prompt is near the target (``--target-tokens``, else what ``ctx`` allows) and
    every request fits ``ctx`` (None: no limit). Returns (requests, retry turns, result sizes, scale)."""
    lo, hi = args.result_tokens
    raw = np.random.default_rng(args.seed + 1).uniform(lo, hi, args.turns * args.calls_per_turn + args.retries)
    target = args.target_tokens
    if ctx is not None:
        target = min(ctx - args.max_tokens - 8, target if target is not None else ctx)
    scale = 1.0
    for _ in range(8):
        reqs, retry_turns, sizes = build_session(encode, render, args, scale, raw)
        final = len(reqs[-1]["ids"]) if reqs[-1]["kind"] != "side" else len(reqs[-2]["ids"])
        longest = max(len(r["ids"]) for r in reqs)
        fixed = len(reqs[0]["ids"])
        fits = ctx is None or longest + args.max_tokens <= ctx
        if fits and (target is None or (scale == 1.0 and final <= target)):
            break  # as drawn
        if fits and abs(final - target) <= max(64, target // 50):
            break
        over = max(final - target, longest + args.max_tokens - (ctx if ctx is not None else longest) + 8)
        # the results' tokens scale about linearly; the rest of the session does not
        scale = min(1.0, scale * max(0.05, (final - fixed - over) / max(final - fixed, 1)))
    if ctx is not None and longest + args.max_tokens > ctx:
        raise SystemExit(f"the session does not fit the {ctx}-token context: {longest} prompt tokens; lower "
                         "--system-tokens or --turns, or raise --ctx")
    return reqs, retry_turns, sizes, scale


# ---- running ------------------------------------------------------------------------------------------------------
def clear(model) -> None:
    """An empty KV pool: the decoder's sequence, the prefix cache and the anchors gone (nothing may leak)."""
    model.decoder.reset()
    model.cached_ids = []
    model.prefix_cache.clear()
    model.anchors.clear()
    pool = model.decoder.pool
    if pool.free_blocks != pool.num_blocks:
        raise RuntimeError(f"{pool.num_blocks - pool.free_blocks} KV blocks still held after clearing")


class Instrument:
    """Timing wrappers on the anchor store's create / restore, and a copy of every logits row generation samples a
    token from (the sampler's input)."""

    def __init__(self, model):
        self.model = model
        self.create_s = self.restore_s = 0.0
        self.creates = self.new_anchors = self.restores = self.spills = self.reads_back = 0
        self.rows: list[np.ndarray] = []
        from freetoken.engine.decoding.sampling import Sampler

        store = model.anchors
        create, restore, sample = store.create, store.restore, Sampler.__call__
        to_host, to_device = store._to_host, store._read_back

        def timed_create(seq, tokens, length=None, **kw):
            before = len(store.anchors)
            t0 = time.perf_counter()
            try:
                return create(seq, tokens, length, **kw)
            finally:
                self.create_s += time.perf_counter() - t0
                self.creates += 1
                self.new_anchors += len(store.anchors) > before

        def timed_restore(*a, **kw):
            t0 = time.perf_counter()
            try:
                return restore(*a, **kw)
            finally:
                self.restore_s += time.perf_counter() - t0
                self.restores += 1

        def captured_sample(sampler, logits, previous=()):
            self.rows.append(np.array(logits, np.float32))
            return sample(sampler, logits, previous)

        def counted_to_host(*a, **kw):
            self.spills += 1
            return to_host(*a, **kw)

        def counted_to_device(*a, **kw):
            self.reads_back += 1
            return to_device(*a, **kw)

        store.create, store.restore, Sampler.__call__ = timed_create, timed_restore, captured_sample
        store._to_host, store._read_back = counted_to_host, counted_to_device

        def undo():
            for name in ("create", "restore", "_to_host", "_read_back"):
                store.__dict__.pop(name)
            Sampler.__call__ = sample
        self._undo = undo

    def close(self):
        self._undo()


def run_mode(model, mode: str, reqs, template, encode, args):
    from freetoken.engine.decoding.sampling import SamplingParams
    from freetoken.engine.generation.chat import message_boundaries
    from freetoken.models.kv import OutOfKVBlocks

    clear(model)
    cache, store = model.prefix_cache, model.anchors
    ev0, rest0, ref0 = cache.evicted, store.restored, len(store.refusals)
    inst = Instrument(model)
    greedy = SamplingParams(temperature=0.0)
    rows, logits = [], []
    try:
        for i, r in enumerate(reqs):
            ids = r["ids"]
            bounds = message_boundaries(template, r["messages"], encode, ids) if mode == "radix" else ()
            if mode == "single":
                cache.clear()
            c0, s0 = inst.create_s, inst.restore_s
            inst.rows = []
            t0 = time.perf_counter()
            gen = model.generate(ids, args.max_tokens, greedy, reuse_cache=mode != "none", boundaries=bounds)
            toks, error, ttft = [], None, float("nan")
            try:
                for tok in gen:
                    if not toks:
                        ttft = time.perf_counter() - t0
                    toks.append(int(tok))
            except OutOfKVBlocks as e:  # counted and reported; the next request starts from a fresh sequence
                error = str(e)
                model.decoder.reset()
                model.cached_ids = []
            total = time.perf_counter() - t0
            st = gen.stats
            if error and st.prompt_tokens + st.cached_tokens != len(ids):  # failed before the prefill was planned
                st.prompt_tokens, st.cached_tokens = len(ids), 0
            rows.append({"mode": mode, "request": i, "turn": r["turn"], "call": r["call"], "kind": r["kind"],
                         "prompt_tokens": len(ids),
                         "prefilled": st.prompt_tokens, "cached": st.cached_tokens, "ttft_s": ttft,
                         "prefill_s": st.prefill_seconds, "total_s": total, "generated": len(toks),
                         "anchor_restored": st.anchor is not None, "anchor_refused": st.anchor_refused,
                         "anchors_made": len(st.anchors_made), "boundaries": len(bounds),
                         "anchor_create_s": inst.create_s - c0, "anchor_restore_s": inst.restore_s - s0,
                         "error": error, "tokens": toks})
            logits.append(inst.rows[:len(toks)])
            note = " anchor" if st.anchor is not None else " refused" if st.anchor_refused else ""
            note += f"  FAILED: {error}" if error else ""
            print(f"  {mode:<6} #{i:<2} turn {r['turn']:>2}.{r['call']} {r['kind']:<5} prompt {len(ids):>5}  prefilled "
                  f"{st.prompt_tokens:>5}  cached {st.cached_tokens:>5}  ttft {ttft:6.2f} s{note}", file=sys.stderr,
                  flush=True)
    finally:
        inst.close()
    info = {"failed_requests": [x["request"] for x in rows if x["error"]], "evicted_blocks": cache.evicted - ev0,
            "anchors_created": inst.new_anchors,
            "anchor_create_calls": inst.creates, "anchors_restored": store.restored - rest0,
            "anchor_restore_calls": inst.restores, "anchors_refused": len(store.refusals) - ref0,
            "refusals": [why for _, why in store.refusals[ref0:]], "anchor_create_s": inst.create_s,
            "anchor_restore_s": inst.restore_s,
            "anchor_spills_to_host": inst.spills, "anchor_reads_back": inst.reads_back,
            "anchor_tiers": {t: sum(a.where == t for a in store.anchors.values()) for t in ("device", "host", "disk")},
            "anchor_host_bytes": store.host_bytes_held(),
            "anchor_device_blocks": len(set(store.held_blocks())), "anchor_device_budget": store.device_blocks,
            "pool_free_blocks_at_end": model.decoder.pool.free_blocks}
    clear(model)
    return rows, logits, info


def compare(ref_rows, ref_logits, rows, logits) -> dict:
    """Token agreement with the reference mode, and the largest relative logits difference (up to the first
    differing token of each request)."""
    mismatched, worst, details, failed = [], 0.0, [], []
    for a, la, b, lb in zip(ref_rows, ref_logits, rows, logits, strict=True):
        if a["error"] or b["error"]:  # no tokens to compare
            failed.append(a["request"])
            continue
        n = min(len(a["tokens"]), len(b["tokens"]))
        first = next((j for j in range(n) if a["tokens"][j] != b["tokens"][j]), None)
        if first is None and len(a["tokens"]) != len(b["tokens"]):
            first = n
        upto = n if first is None else min(first + 1, n)
        rel = max((float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30))
                   for x, y in zip(la[:upto], lb[:upto], strict=True)), default=0.0)
        worst = max(worst, rel)
        if first is not None:
            mismatched.append(a["request"])
            d = {"request": a["request"], "first_diff": first, "rel_logit_diff": rel}
            if first < min(len(la), len(lb)):
                x = la[first]
                d["ref_margin"] = float(x[a["tokens"][first]] - x[b["tokens"][first]])  # the near tie, if one
            details.append(d)
    return {"mismatched_requests": mismatched, "max_rel_logit_diff": worst, "details": details,
            "failed_requests": failed}


def ideal_prefill(reqs, generated) -> list[int]:
    """Per request, the tokens no reuse can avoid: the prompt less its longest common prefix with any earlier
    request's prompt and generated tokens (the last prompt token is always run), i.e. what an unbounded exact
    prefix cache would prefill. It bounds every mode's saving: session none/ideal is the most any reuse can give."""
    out, seen = [], []
    for r, gen in zip(reqs, generated, strict=True):
        ids = r["ids"]
        best = 0
        for s in seen:
            n = min(len(s), len(ids) - 1)
            k = next((j for j in range(n) if s[j] != ids[j]), n)
            best = max(best, k)
        out.append(len(ids) - best)
        seen.append(list(ids) + list(gen))
    return out


def _ctx_arg(text: str):
    """--ctx: a token count, or ``fit``."""
    if text == "fit":
        return text
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count or 'fit', got {text!r}") from None
    if v < 64:
        raise argparse.ArgumentTypeError(f"must be >= 64, got {text}")
    return v


def _kv_arg(text: str):
    """--kv-memory: a size (``12MiB``, parsed by :func:`freetoken.cli.args.size`), or ``fit+N`` (tokens)."""
    if text == "fit" or text.startswith("fit+"):
        try:
            return ("fit", int(text[4:] or 0))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected fit+TOKENS, got {text!r}") from None
    from freetoken.cli.args import size

    return size(text)


def _range_arg(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI token counts, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text}")
    return lo, hi


#: Defaults per --preset (explicit flags override them); see the module doc.
PRESETS = {
    "default": {},
    "spec": {"turns": 12, "calls_per_turn": 1, "result_tokens": (300, 2000), "system_tokens": 3000, "ctx": "fit"},
    "agent": {"turns": 12, "calls_per_turn": 3, "result_tokens": (100, 600), "ctx": "fit"},
    "pressure": {"kv_memory": ("fit", 2000), "side_tokens": 3000},
}
#: --target-tokens of the presets that keep the earlier default session (when no --ctx is given).
LEGACY_TARGET = 7700


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=tuple(PRESETS), default="default",
                    help="a session's defaults (default: the earlier default session); explicit flags override")
    ap.add_argument("--device", default="cpu", help="the device to load the bundled model on (default cpu)")
    ap.add_argument("--model", default=None, help="a model path (default: the bundled model)")
    ap.add_argument("--turns", type=int, default=12, help="tool-call turns after the first request (default 12)")
    ap.add_argument("--calls-per-turn", type=int, default=1,
                    help="tool calls per turn, one request each (default 1); a retry replaces the turn's last call")
    ap.add_argument("--retries", type=int, default=4, help="turns followed by a side request and a retry (4)")
    ap.add_argument("--system-tokens", type=int, default=3000, help="system prompt size (default 3000)")
    ap.add_argument("--result-tokens", type=_range_arg, default=(300, 2000), metavar="LO,HI",
                    help="the range the tool results' token sizes are drawn from (default 300,2000)")
    ap.add_argument("--target-tokens", type=int, default=None,
                    help="the largest final prompt: the tool results are scaled down (never up) to end near it when "
                         "the session as drawn is longer (default: what --ctx allows; presets default and pressure "
                         f"without --ctx: {LEGACY_TARGET}, the earlier default session)")
    ap.add_argument("--side-tokens", type=int, default=None,
                    help="the side requests' size in tokens (default: as it comes, about 300-400; a large one, "
                         "e.g. 3000, is a sub-agent with its own context)")
    ap.add_argument("--ctx", type=_ctx_arg, default=None, metavar="N|fit",
                    help="the model's context (freetoken.load ctx=; default the model's own, 32768 for the bundled "
                         "one; beyond its trained positions it only warns); fit: the session's longest request and a "
                         "block")
    ap.add_argument("--kv-memory", type=_kv_arg, default=None, metavar="SIZE|fit+N",
                    help="the KV pool (freetoken.load kv_memory=), e.g. 12MiB; fit+N: the longest request and N "
                         "tokens more, rounded up to whole blocks (default: what the context needs)")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per request (default 16)")
    ap.add_argument("--template", choices=("chatml", "model"), default="chatml",
                    help="ChatML (default; the bundled model's own template writes the contents only, no roles) "
                         "or the model's template")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of none,single,radix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write every row and the summary to this file")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=tuple(PRESETS), default="default")
    ap.set_defaults(**PRESETS[pre.parse_known_args(argv)[0].preset])
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: choose from {','.join(MODES)}")
    if args.turns < 1 or args.retries < 0 or args.max_tokens < 1 or args.calls_per_turn < 1:
        ap.error("--turns, --calls-per-turn and --max-tokens must be >= 1, --retries >= 0")
    args.retries = min(args.retries, max(args.turns - 1, 0))
    if args.target_tokens is None and args.ctx is None and args.preset in ("default", "pressure"):
        args.target_tokens = LEGACY_TARGET

    import freetoken
    from freetoken.engine.generation.chat import ChatTemplate, _special_tokens, model_template
    from freetoken.models.kv import kv_block_bytes

    def load(ctx, kv_memory):
        t0 = time.perf_counter()
        m = freetoken.load(args.model, device=args.device, ctx=ctx, kv_memory=kv_memory)
        return m, time.perf_counter() - t0

    fit_ctx, fit_kv = args.ctx == "fit", isinstance(args.kv_memory, tuple)
    model, load_s = load(None if fit_ctx else args.ctx, None if fit_kv else args.kv_memory)

    def encode(text):
        return model.encode(text, add_special_tokens=False)

    def render(messages):
        return template.render(messages, add_generation_prompt=True)

    template = model_template(model) if args.template == "model" else ChatTemplate.chatml(_special_tokens(model))
    reqs, retry_turns, sizes, scale = fit_session(encode, render, args, None if fit_ctx else model.decoder.ctx)
    longest = max(len(r["ids"]) for r in reqs) + args.max_tokens
    if fit_ctx or fit_kv:  # sized from the session: load again with that context / pool
        bs, cfg = model.decoder.pool.block_size, model.decoder.cfg
        ctx = -(-longest // bs) * bs + bs if fit_ctx else args.ctx  # one block spare: see the module doc
        kv = args.kv_memory
        if fit_kv:
            kv = -(-(longest + args.kv_memory[1]) // bs) * kv_block_bytes(cfg.num_layers, cfg.num_kv_heads,
                                                                         cfg.head_dim, model.decoder.pool.kind, bs)
        del model
        model, load_s = load(ctx, kv)
        template = model_template(model) if args.template == "model" else ChatTemplate.chatml(_special_tokens(model))
    ctx = model.decoder.ctx
    if longest > ctx:
        raise SystemExit(f"the session's longest request ({longest} tokens with its generated ones) does not fit the "
                         f"{ctx}-token context of this KV pool")
    final = max(len(r["ids"]) for r in reqs if r["kind"] != "side")
    side = [len(r["ids"]) for r in reqs if r["kind"] == "side"]
    pool = model.decoder.pool
    print(f"# bench_agent: preset {args.preset}, {args.device}, ctx {ctx}, KV pool {pool.num_blocks} blocks x "
          f"{pool.block_size} tokens ({pool.num_blocks * pool.block_size} tokens, {pool.nbytes / 2**20:.1f} MiB), "
          f"anchor device budget {model.anchors.device_blocks} blocks, template {template.name}; load {load_s:.1f} s",
          file=sys.stderr)
    print(f"# session: {len(reqs)} requests, system {len(reqs[0]['ids'])} tokens (with the task), final prompt "
          f"{final} tokens, {args.calls_per_turn} call(s) per turn, tool results {min(sizes)}-{max(sizes)} tokens "
          f"(drawn {args.result_tokens[0]}-{args.result_tokens[1]}, scale {scale:.3f}), side requests "
          f"{min(side, default=0)}-{max(side, default=0)} tokens, retries after turns {retry_turns}",
          file=sys.stderr, flush=True)

    # warm-up (kernels, buffers), then an empty pool for every mode
    list(model.generate(reqs[0]["ids"][:300], 2, None, reuse_cache=False))
    results, logits, infos = {}, {}, {}
    for mode in modes:
        results[mode], logits[mode], infos[mode] = run_mode(model, mode, reqs, template, encode, args)
    ref = "none" if "none" in modes else modes[0]
    checks = {m: compare(results[ref], logits[ref], results[m], logits[m]) for m in modes if m != ref}
    ideal = ideal_prefill(reqs, [x["tokens"] for x in results[ref]])

    # ---- tables ----
    print(f"\nSession (preset {args.preset}): {len(reqs)} requests ({args.turns} turns x {args.calls_per_turn} "
          f"call(s) + turn 0, {len(retry_turns)} side + {len(retry_turns)} retry), {args.max_tokens} greedy tokens "
          f"each, final prompt {final} tokens, tool results {min(sizes)}-{max(sizes)} tokens (scale {scale:.3f} of "
          f"the drawn {args.result_tokens[0]}-{args.result_tokens[1]}), side requests {min(side, default=0)}-"
          f"{max(side, default=0)} tokens; ctx {ctx}, KV pool {pool.num_blocks} blocks of {pool.block_size} tokens "
          f"({pool.nbytes / 2**20:.1f} MiB), device {args.device}.\n")
    anchor_col = "radix" in modes
    head = "| # | turn | kind | prompt | ideal |" + "".join(
        f" {m} prefilled | {m} cached | {m} TTFT s |" for m in modes) + (" anchor | radix anchor s |"
                                                                        if anchor_col else "")
    print(head)
    print("|" + "---|" * (5 + 3 * len(modes) + 2 * anchor_col))
    for i, r in enumerate(reqs):
        cells = "".join(f" {results[m][i]['prefilled']} | {results[m][i]['cached']} | {results[m][i]['ttft_s']:.2f} |"
                        for m in modes)
        if anchor_col:
            x = results["radix"][i]
            used = "restored" if x["anchor_restored"] else "refused" if x["anchor_refused"] else "-"
            cells += f" {used} | {x['anchor_create_s'] + x['anchor_restore_s']:.2f} |"
        turn = r["turn"] if args.calls_per_turn == 1 else f"{r['turn']}.{r['call']}"
        print(f"| {i} | {turn} | {r['kind']} | {len(r['ids'])} | {ideal[i]} |{cells}")

    summary = {}
    for m in modes:
        rs = results[m]
        retry = [x for x in rs if x["kind"] == "retry"]
        summary[m] = {"prefilled": sum(x["prefilled"] for x in rs), "cached": sum(x["cached"] for x in rs),
                      "ttft_s": sum(x["ttft_s"] for x in rs if not x["error"]),
                      "retry_prefilled": sum(x["prefilled"] for x in retry),
                      "retry_ttft_s": sum(x["ttft_s"] for x in retry if not x["error"])}
    retry_ideal = sum(n for n, r in zip(ideal, reqs, strict=True) if r["kind"] == "retry")
    print("\n| mode | prefilled tokens | cached tokens | total TTFT s | retry prefilled | retry TTFT s |")
    print("|---|---|---|---|---|---|")
    print(f"| (ideal) | {sum(ideal)} | {sum(len(r['ids']) for r in reqs) - sum(ideal)} | - | {retry_ideal} | - |")
    for m in modes:
        s = summary[m]
        print(f"| {m} | {s['prefilled']} | {s['cached']} | {s['ttft_s']:.2f} | {s['retry_prefilled']} | "
              f"{s['retry_ttft_s']:.2f} |")

    ratios = {}
    if "none" in summary:
        ratios["session none/ideal"] = summary["none"]["prefilled"] / max(sum(ideal), 1)
    if "radix" in summary:
        rad = summary["radix"]
        if "none" in summary:
            ratios["session none/radix"] = summary["none"]["prefilled"] / max(rad["prefilled"], 1)
            ratios["TTFT none/radix"] = summary["none"]["ttft_s"] / max(rad["ttft_s"], 1e-9)
        if "single" in summary:
            ratios["session single/radix"] = summary["single"]["prefilled"] / max(rad["prefilled"], 1)
            ratios["retry single/radix"] = summary["single"]["retry_prefilled"] / max(rad["retry_prefilled"], 1)
            ratios["retry TTFT single/radix"] = summary["single"]["retry_ttft_s"] / max(rad["retry_ttft_s"], 1e-9)
    print()
    for k, v in ratios.items():
        target = TARGETS.get(k)
        mark = "" if target is None else f"  (target >= {target:g}x: {'met' if v >= target else 'NOT met'})"
        note = "  (the most any reuse can save on this session)" if k.endswith("/ideal") else ""
        print(f"prefilled {k}: {v:.1f}x{mark}{note}" if not k.startswith(("TTFT", "retry TTFT"))
              else f"{k}: {v:.1f}x")
    if "radix" in infos:
        i = infos["radix"]
        n_req, spent = len(reqs), i["anchor_create_s"] + i["anchor_restore_s"]
        print(f"\nradix: prefix cache evicted {i['evicted_blocks']} blocks; anchors created {i['anchors_created']} "
              f"({i['anchor_create_calls']} create calls), restored {i['anchors_restored']}, refused "
              f"{i['anchors_refused']}; at the end {i['anchor_tiers']} (device: {i['anchor_device_blocks']} distinct "
              f"blocks, budget {i['anchor_device_budget']}; host copies {i['anchor_host_bytes'] / 2**20:.2f} MiB, "
              f"{i['anchor_host_bytes']} bytes)")
        restored_at = [x["request"] for x in results["radix"] if x["anchor_restored"]]
        print(f"radix: anchors spilled to host {i['anchor_spills_to_host']} times, read back to the device "
              f"{i['anchor_reads_back']} times; requests restored from an anchor: {restored_at or 'none'}; KV pool "
              f"{pool.num_blocks} blocks, {i['pool_free_blocks_at_end']} free at the end")
        print(f"radix: anchor cost: create {i['anchor_create_s']:.3f} s, restore (verify) {i['anchor_restore_s']:.3f}"
              f" s over {n_req} requests ({spent / max(summary['radix']['ttft_s'], 1e-9):.1%} of the radix TTFT)")
        if "single" in results:
            turn_ttft = {m: sum(x["ttft_s"] for x in results[m] if x["kind"] == "turn") for m in ("single", "radix")}
            print(f"radix: TTFT on plain turns (both modes reuse the last sequence there): single "
                  f"{turn_ttft['single']:.2f} s, radix {turn_ttft['radix']:.2f} s")
        for why in i["refusals"]:
            print(f"  refused: {why}")
    for m in modes:
        failed = [x for x in results[m] if x["error"]]
        if failed:
            print(f"{m}: {len(failed)} request(s) FAILED (counted above with their planned prefill, the whole prompt "
                  "when they failed before it was planned): "
                  + "; ".join(f"#{x['request']} {x['kind']}: {x['error']}" for x in failed))
    for m, c in checks.items():
        mism = c["mismatched_requests"]
        same = "identical in every request compared" if not mism else f"differ in {len(mism)} request(s) {mism}"
        skipped = f" (failed requests {c['failed_requests']} not compared)" if c["failed_requests"] else ""
        print(f"{m} vs {ref}: tokens {same}{skipped}; max relative logits difference {c['max_rel_logit_diff']:.2e}")
        for d in c["details"]:
            print(f"  request {d['request']}: first differing token {d['first_diff']}, rel. logits diff "
                  f"{d['rel_logit_diff']:.2e}, {ref} margin {d.get('ref_margin', float('nan')):.3g}")

    if args.json is not None:
        out = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "ctx": ctx, "kv_pool_blocks": pool.num_blocks, "kv_block_tokens": pool.block_size,
               "kv_pool_bytes": pool.nbytes, "result_scale": scale, "side_request_tokens": side,
               "final_prompt_tokens": final, "retry_turns": retry_turns, "tool_result_tokens": sizes,
               "rows": [x for m in modes for x in results[m]], "ideal_prefilled": ideal, "summary": summary,
               "ratios": ratios, "radix": infos.get("radix"), "infos": infos, "checks": checks}
        args.json.write_text(json.dumps(out, indent=1))
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
