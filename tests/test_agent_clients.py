"""The real coding agents, unmodified, against `freetoken serve` on the bundled model: OpenAI's Codex CLI (`codex
exec`, the Responses API) and Claude Code (`claude -p`, the Anthropic Messages API), the versions pinned in
tests/clients/package.json (`npm ci --prefix tests/clients`, done by `scripts/setup --test-oracles`), each headless
in a fresh HOME with its telemetry and update checks off (tests/clients/capture_requests.py: the same settings).

What is checked is the protocol: every request the agent sends gets a 2xx, and the agent reads the reply (its
message, its usage). The bundled model writes code-like text and never ends a turn by itself, so each reply runs
to ``--max-tokens-limit``: Codex then ends its turn with "Incomplete response returned" and Claude Code with its
output-limit error, both after reading our reply. Their prompts (13k and 28k tokens with their tools) fit the
server's default context, the bundled model's 32,768 positions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import KEY, MODEL, running_server

from freetoken.testing.oracles import need_program

CLIENTS = Path(__file__).parent / "clients"
sys.path.insert(0, str(CLIENTS))
import capture_requests  # noqa: E402 - tests/clients is not a package: its settings are the ones used here

LIMIT = 24  # tokens per reply (--max-tokens-limit): the agents ask for 32,000
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(tmp_path_factory, "--max-tokens", str(LIMIT), "--max-tokens-limit", str(LIMIT),
                              "--served-model-name", f"{MODEL},test-model", ctx=None)  # the model's own context


def _statuses(server, endpoint: str) -> dict[str, float]:
    import re

    import httpx

    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        rf'^freetoken_requests_total\{{endpoint="{re.escape(endpoint)}",status="(\d+)"\}} (\S+)$', text, re.M)}


def _run(cmd: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=600)


def test_codex_exec_runs_on_the_responses_api(server, tmp_path):
    codex = need_program(str(capture_requests.BIN / "codex"), "npm ci --prefix tests/clients")
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / "work").mkdir()
    (home / ".codex" / "config.toml").write_text(capture_requests.CODEX_CONFIG.format(model="test-model",
                                                                                       base_url=server.url))
    env = {**capture_requests.codex_env(home), "FREETOKEN_API_KEY": KEY}
    p = _run([codex, "exec", "--skip-git-repo-check", "--ephemeral", "--color", "never", "--json", "say hi"], env,
             home / "work")
    events = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    kinds = [e["type"] for e in events]
    assert "turn.started" in kinds, p.stdout + p.stderr
    messages = [e["item"]["text"] for e in events if e["type"] == "item.completed"
                and e["item"]["type"] == "agent_message"]
    assert messages and messages[0], p.stdout  # it read our streamed message
    # the turn ends either completed or on the bundled model's cut reply: nothing else (no protocol error)
    failures = [e["error"]["message"] for e in events if e["type"] == "turn.failed"]
    assert "turn.completed" in kinds or failures == ["Incomplete response returned, reason: max_output_tokens"], \
        p.stdout
    statuses = _statuses(server, "/v1/responses")
    assert statuses and set(statuses) == {"200"}, statuses


def test_claude_code_print_runs_on_the_messages_api(server, tmp_path):
    claude = need_program(str(capture_requests.BIN / "claude"), "npm ci --prefix tests/clients")
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    env = {**capture_requests.claude_env(home, server.url), "ANTHROPIC_API_KEY": KEY}
    p = _run([claude, "-p", "say hi", "--model", "test-model", "--output-format", "json", "--max-turns", "2",
              "--no-session-persistence"], env, home / "work")
    result = json.loads(p.stdout)
    assert result["type"] == "result" and result["api_error_status"] is None, result  # no 4xx/5xx reached it
    usage = result["usage"]
    assert usage["output_tokens"] >= LIMIT and usage["input_tokens"] + usage["cache_read_input_tokens"] > 20000
    assert result["is_error"] is False or "output token maximum" in result["result"], result
    statuses = _statuses(server, "/v1/messages")
    assert statuses and set(statuses) == {"200"}, statuses
    assert set(_statuses(server, "/")) <= {"200"}  # its HEAD / probe
