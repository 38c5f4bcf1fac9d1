"""Run the real coding agents against record_server.py and save what they send.

Runs the pinned OpenAI Codex CLI and Claude Code (installed with
``npm ci --prefix tests/clients``) headless, each in a fresh temporary HOME,
against a local recording server, checks that every run exits 0, and writes
the request bodies to ``tests/clients/captured/<name>.json`` plus
``captured/index.json`` (method, path, query, headers of every request of
every scenario, including the ones without a body such as ``HEAD /``).

    python tests/clients/capture_requests.py            # all scenarios
    python tests/clients/capture_requests.py --netns    # same, inside a fresh
                                                         # network namespace
                                                         # (root; only loopback)
    python tests/clients/capture_requests.py -k codex --logs /tmp/raw

The environment and config used here are the ones to use in CI: see
``codex_env`` / ``claude_env`` below.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = HERE / "node_modules" / ".bin"
RECORDER = HERE / "record_server.py"
OUT = HERE / "captured"
FAKE_KEY = "sk-test-key"

CODEX_CONFIG = """\
model = "{model}"
model_provider = "freetoken"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[model_providers.freetoken]
name = "freetoken"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "FREETOKEN_API_KEY"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 600000

[features]
plugins = false

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
"""

# name, client, prompt, client args, recorder args, extra env, {capture_name: index of the POST}
SCENARIOS = [
    ("codex_hi", "codex", "say hi", [], [], {}, {"codex_responses_hi": 0}),
    (
        "codex_tool",
        "codex",
        "RUN_TOOL: run echo hello-from-tool",
        [],
        ["--thinking"],
        {},
        {"codex_responses_tool_followup": 1},
    ),
    (
        "codex_gpt55_patch",
        "codex",
        "RUN_PATCH: create hello.txt",
        ["-m", "gpt-5.5"],
        [],
        {},
        {"codex_responses_gpt55_hi": 0, "codex_responses_gpt55_patch_followup": 1},
    ),
    (
        "codex_minimal",
        "codex",
        "say hi",
        [
            "--disable",
            "multi_agent",
            "--disable",
            "goals",
            "--disable",
            "view_image",
            "--disable",
            "apps",
            "--disable",
            "skill_search",
            "--disable",
            "image_generation",
            "-c",
            'web_search="disabled"',
            "-c",
            'model_instructions_file="{work}/instructions.md"',
        ],
        [],
        {},
        {"codex_responses_minimal_hi": 0},
    ),
    ("claude_hi", "claude", "say hi", [], [], {}, {"claude_messages_hi": 0}),
    (
        "claude_sonnet45",
        "claude",
        "say hi",
        ["--model", "claude-sonnet-4-5-20250929", "--tools", "Bash"],
        [],
        {},
        {"claude_messages_sonnet45_hi": 0},
    ),
    (
        "claude_tool",
        "claude",
        "RUN_TOOL: run echo hello-from-tool",
        ["--tools", "Bash"],
        ["--thinking"],
        {},
        {"claude_messages_tool_followup": 1},
    ),
    (
        "claude_denied",
        "claude",
        "RUN_TOOL: make a directory",
        ["--tools", "Bash"],
        ["--tool-command", "mkdir made_by_tool"],
        {},
        {"claude_messages_tool_denied_followup": 1},
    ),
    (
        "claude_write",
        "claude",
        "RUN_PATCH: create hello.txt",
        ["--tools", "Bash,Read,Edit,Write", "--dangerously-skip-permissions"],
        [],
        {"IS_SANDBOX": "1"},
        {"claude_messages_write_followup": 1},
    ),
    (
        "claude_nonstream",
        "claude",
        "say hi",
        ["--tools", "Bash"],
        ["--fault", "no_event_lines"],
        {},
        {"claude_messages_nonstream_fallback": 1},
    ),
    ("claude_bare", "claude", "say hi", ["--bare"], [], {}, {"claude_messages_bare_hi": 0}),
]


def base_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "USER")}
    env.update(HOME=str(home), NO_COLOR="1")
    return env


def codex_env(home: Path) -> dict:
    env = base_env(home)
    env.update(CODEX_HOME=str(home / ".codex"), FREETOKEN_API_KEY=FAKE_KEY)
    return env


def claude_env(home: Path, base_url: str) -> dict:
    env = base_env(home)
    env.update(
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY=FAKE_KEY,
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",  # also turns off telemetry, error reports, autoupdate
        DISABLE_AUTOUPDATER="1",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        CLAUDE_CODE_MAX_RETRIES="1",
        API_TIMEOUT_MS="600000",
    )
    return env


def start_recorder(log: Path, args: list[str]):
    port_file = log.with_suffix(".port")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(RECORDER),
            "--port",
            "0",
            "--log",
            str(log),
            "--port-file",
            str(port_file),
            "--quiet",
            *args,
        ],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(100):
        if port_file.exists() and port_file.read_text():
            return proc, int(port_file.read_text())
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("recorder did not start")


def run_scenario(scn, root: Path, timeout: float):
    name, client, prompt, cargs, rargs, extra_env, _ = scn
    sdir = root / name
    home, work = sdir / "home", sdir / "work"
    home.mkdir(parents=True)
    work.mkdir()
    (work / "instructions.md").write_text("You are a coding agent under test.\n")
    log = sdir / "requests.jsonl"
    proc, port = start_recorder(log, rargs)
    base_url = f"http://127.0.0.1:{port}"
    cargs = [a.replace("{work}", str(work)) for a in cargs]
    try:
        if client == "codex":
            (home / ".codex").mkdir()
            (home / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(model="test-model", base_url=base_url))
            env = codex_env(home)
            cmd = [
                str(BIN / "codex"),
                "exec",
                "--skip-git-repo-check",
                "--ephemeral",
                "--color",
                "never",
                *cargs,
                prompt,
            ]
        else:
            env = claude_env(home, base_url)
            cmd = [
                str(BIN / "claude"),
                "-p",
                prompt,
                "--model",
                "test-model",
                "--output-format",
                "json",
                "--max-turns",
                "4",
                "--no-session-persistence",
                *cargs,
            ]
            if "--model" in cargs:  # scenario picks its own model
                i = cmd.index("--model")
                del cmd[i : i + 2]
        env.update(extra_env)
        t0 = time.time()
        res = subprocess.run(
            cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
        dt = time.time() - t0
    finally:
        proc.terminate()
        proc.wait()
    reqs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return res, dt, reqs, str(sdir)


def scrub(obj, root: str):
    """Replace the temporary directory in captured text with a stable placeholder."""
    text = json.dumps(obj, ensure_ascii=False)
    return json.loads(text.replace(root, "/tmp/agent-capture"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only scenarios whose name contains this")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--logs", type=Path, help="also copy each scenario's raw requests.jsonl here")
    ap.add_argument(
        "--netns",
        action="store_true",
        help="re-run inside `unshare -n` (needs root): only loopback exists, so any request "
        "to anything but the recorder fails",
    )
    args = ap.parse_args(argv)
    if args.netns:
        inner = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--netns"]
        cmd = "ip link set lo up && exec " + " ".join(
            subprocess.list2cmdline([x]) for x in [sys.executable, __file__, *inner]
        )
        return subprocess.call(["unshare", "-n", "--", "sh", "-c", cmd])
    for b in ("codex", "claude"):
        if not (BIN / b).exists():
            sys.exit(f"{BIN / b} missing: run `npm ci --prefix {HERE}` first")
    args.out.mkdir(exist_ok=True)
    index_path = args.out / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    with tempfile.TemporaryDirectory(prefix="agent-version-") as vhome:
        versions = {
            b: subprocess.run(
                [str(BIN / b), "--version"], capture_output=True, text=True, env={**os.environ, "HOME": vhome}
            ).stdout.strip()
            for b in ("codex", "claude")
        }
    root = Path(tempfile.mkdtemp(prefix="agent-capture-"))
    failed = 0
    try:
        for scn in SCENARIOS:
            name, client, prompt, cargs, rargs, extra_env, wanted = scn
            if args.k not in name:
                continue
            res, dt, reqs, sdir = run_scenario(scn, root, args.timeout)
            ok = res.returncode == 0
            failed += not ok
            print(
                f"{name:20s} rc={res.returncode} {dt:5.1f}s requests={len(reqs)} "
                + " ".join(f"{r['method']} {r['path']}" for r in reqs)
            )
            if not ok:
                print(res.stdout[-2000:], res.stderr[-2000:], sep="\n")
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                shutil.copy(Path(sdir) / "requests.jsonl", args.logs / f"{name}.jsonl")
            posts = [r for r in reqs if r["method"] == "POST"]
            index[name] = {
                "client": client,
                "client_version": versions[client],
                "prompt": prompt,
                "client_args": cargs,
                "recorder_args": rargs,
                "extra_env": extra_env,
                "exit_code": res.returncode,
                "requests": [
                    scrub({k: r.get(k) for k in ("method", "path", "query", "headers")}, str(root)) for r in reqs
                ],
                "captures": {},
            }
            for cap, i in wanted.items():
                if i >= len(posts) or "body" not in posts[i]:
                    print(f"  !! {cap}: POST #{i} not captured")
                    failed += 1
                    continue
                body = scrub(posts[i]["body"], str(root))
                (args.out / f"{cap}.json").write_text(json.dumps(body, indent=1, ensure_ascii=False) + "\n")
                index[name]["captures"][cap] = {"post_index": i, "path": posts[i]["path"], "query": posts[i]["query"]}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    index_path.write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
