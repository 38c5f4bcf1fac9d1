"""`freetoken serve`'s anchors against the real `openai` client (and httpx for the bodies): a live server in a
subprocess (the bundled model on the cpu device), and the bundled model in process to recompute each greedy answer
from scratch (no reuse), which a reused or restored prompt must give too.

Chat requests make anchors at their message boundaries and report what came of them in the extra field
``anchor`` (``{"restored", "refused", "made"}``); ``POST/GET/DELETE /v1/anchors`` make, list and drop them;
``--anchor-dir`` keeps them across a restart, and a damaged file is refused (the request recomputed).
"""

from __future__ import annotations

import struct

import httpx
import pytest
from live_server import CTX, KEY, MODEL, Server, running_server

from freetoken.engine.decoding.sampling import SamplingParams
from freetoken.engine.generation.chat import model_template
from freetoken.engine.reuse.anchors import FILE_SUFFIX

MAX_TOKENS = 6
#: (no newline at its end: the template adds one, and "\n\n" at the end of a text is one token of the bundled
#: tokenizer but two before "def", which would leave the system prompt's boundary out of the prompt's tokens)
SYSTEM = "You review Python code." + "".join(f"\n# rule {i}: keep functions short and name things well"
                                             for i in range(8))


def _conv(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(tmp_path_factory)


class _Engine:
    """The bundled model in process: prompts rendered as the server renders them, answers recomputed whole."""

    def __init__(self):
        from freetoken.engine.loading.load import load

        self.model = load(None, device="cpu", ctx=CTX)
        self.template = model_template(self.model)

    def ids(self, messages, generation_prompt: bool = True) -> list[int]:
        text = self.template.render(messages, add_generation_prompt=generation_prompt)
        return self.model.encode(text, add_special_tokens=False)

    def answer(self, messages) -> str:
        return "".join(self.model.generate_text(self.ids(messages), MAX_TOKENS, SamplingParams(temperature=0),
                                                stop=self.template.stop_strings()))


@pytest.fixture(scope="module")
def engine():
    return _Engine()


def _chat(server, messages, anchor: str | None = None, **kw):
    extra = {"anchor": anchor} if anchor is not None else None
    return server.client().chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                   max_tokens=MAX_TOKENS, extra_body=extra, **kw)


def _cached(resp) -> int:
    return resp.usage.prompt_tokens_details.cached_tokens


def _anchor_field(resp) -> dict:
    return resp.model_extra["anchor"]


def _make_anchor(server, body) -> dict:
    r = server.post("/v1/anchors", body)
    assert r.status_code == 200, r.text
    return r.json()


def _listed(server) -> dict[str, dict]:
    r = httpx.get(server.url + "/v1/anchors", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "list", r.text
    return {a["id"]: a for a in r.json()["data"]}


def _delete(server, aid: str) -> httpx.Response:
    return httpx.delete(f"{server.url}/v1/anchors/{aid}", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_a_shared_system_prompt_is_reused(server, engine):
    system_tokens = len(engine.ids(_conv("x")[:1], generation_prompt=False))
    assert system_tokens > 64  # more than a KV block
    first = _chat(server, _conv("def add(a, b):"))
    assert _cached(first) == 0 and first.choices[0].message.content == engine.answer(_conv("def add(a, b):"))
    made = _anchor_field(first)["made"]
    assert len(made) == 2 and made[0] in _listed(server)  # the system prompt's boundary and the whole prompt
    second = _chat(server, _conv("def mul(a, b):"))
    assert _cached(second) >= system_tokens
    assert second.usage.prompt_tokens == len(engine.ids(_conv("def mul(a, b):")))
    assert second.choices[0].message.content == engine.answer(_conv("def mul(a, b):"))
    assert server.metric("freetoken_anchors_created_total") >= 3
    assert server.metric("freetoken_cached_prompt_tokens_total") >= system_tokens


def test_post_an_anchor_and_resume_from_it(server, engine):
    conv = _conv("def sub(a, b):")
    a = _make_anchor(server, {"messages": conv, "model": MODEL})
    assert a["object"] == "anchor" and len(a["id"]) == 64 and a["tier"] == "device" and not a["on_disk"]
    assert a["tokens"] == len(engine.ids(conv, generation_prompt=False)) and a["cached_tokens"] > 0
    assert _make_anchor(server, {"messages": conv})["id"] == a["id"]  # the same prefix, the same anchor
    _chat(server, _conv("something else entirely"))  # the engine's sequence moves on
    restored = server.metric("freetoken_anchors_restored_total")
    resp = _chat(server, conv, anchor=a["id"])
    assert _cached(resp) >= a["tokens"] - 1
    assert _anchor_field(resp)["restored"] == a["id"] and _anchor_field(resp)["refused"] is None
    assert resp.choices[0].message.content == engine.answer(conv)
    assert server.metric("freetoken_anchors_restored_total") == restored + 1
    # streamed: the finish chunk carries the field, the usage chunk the cached tokens
    chunks = list(_chat(server, conv, anchor=a["id"].upper(), stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == engine.answer(conv)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert finish.model_extra["anchor"]["restored"] == a["id"]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= a["tokens"] - 1
    # the Anthropic route reads the same conversation into the same prompt: the anchor serves it too
    r = server.post("/v1/messages", {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "system": SYSTEM,
                                     "messages": conv[1:], "anchor": a["id"]})
    m = r.json()
    assert r.status_code == 200 and m["anchor"]["restored"] == a["id"], r.text
    u = m["usage"]
    assert u["cache_read_input_tokens"] >= a["tokens"] - 1
    assert u["input_tokens"] + u["cache_read_input_tokens"] == len(engine.ids(conv))
    assert m["content"][0]["text"] == engine.answer(conv)


def test_anchor_a_prompt(server, engine):
    text = SYSTEM + "def div(a, b):\n"
    a = _make_anchor(server, {"prompt": text})
    assert a["tokens"] == len(engine.model.encode(text))
    ids = engine.model.encode("class Point:\n")
    b = _make_anchor(server, {"prompt": ids})
    assert b["tokens"] == len(ids) and b["id"] != a["id"]
    r = server.post("/v1/anchors", {"prompt": [10 ** 9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = server.post("/v1/anchors", {"prompt": "x", "messages": _conv("y")})
    assert r.status_code == 400 and "either messages or prompt" in r.json()["error"]["message"], r.text


def test_list_and_delete(server):
    a = _make_anchor(server, {"messages": _conv("def neg(a):")})
    assert _listed(server)[a["id"]]["tokens"] == a["tokens"]
    r = _delete(server, a["id"])
    assert r.status_code == 200 and r.json() == {"id": a["id"], "object": "anchor", "deleted": True}
    assert a["id"] not in _listed(server)
    r = _delete(server, a["id"])
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["code"] == "anchor_not_found" and error["type"] == "invalid_request_error" and a["id"] in \
        error["message"]


@pytest.mark.parametrize("bad", ["xyz", "0" * 63, "g" * 64, 12])
def test_a_malformed_anchor_id_is_a_400_naming_the_field(server, bad):
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": _conv("hi"), "anchor": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "anchor", r.text
    assert r.json()["error"]["message"].startswith("anchor: ")
    r = server.post("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": _conv("hi")[1:], "anchor": bad})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["message"].startswith("anchor: ")


def test_an_unknown_anchor_is_recomputed_and_reported(server, engine):
    conv = _conv("def mod(a, b):")
    refused = server.metric("freetoken_anchors_refused_total")
    resp = _chat(server, conv, anchor="0" * 64)
    assert _anchor_field(resp)["refused"] == "no such anchor" and _anchor_field(resp)["restored"] is None
    assert resp.choices[0].message.content == engine.answer(conv)
    assert server.metric("freetoken_anchors_refused_total") == refused + 1
    r = server.post("/v1/messages", {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "system": SYSTEM,
                                     "messages": conv[1:], "anchor": "f" * 64})
    assert r.status_code == 200 and r.json()["anchor"]["refused"] == "no such anchor", r.text
    assert r.json()["content"][0]["text"] == engine.answer(conv)


def _flip_a_kv_byte(path) -> None:
    """Flip one byte in the middle of the KV rows of the anchor's first block file (past its header)."""
    from freetoken.engine.reuse.anchors import BLOCK_SUFFIX, FILE_MAGIC, read_frame

    header, _ = read_frame(path, FILE_MAGIC)
    block = path.parent / "blocks" / f"{header['sums'][0]}{BLOCK_SUFFIX}"
    raw = bytearray(block.read_bytes())
    _, _, head = struct.unpack_from("<8sII", raw)
    raw[(16 + head + len(raw) - 16) // 2] ^= 0x40
    block.write_bytes(bytes(raw))


def test_anchor_dir_survives_a_restart_and_a_damaged_file_is_refused(tmp_path, engine):
    folder = tmp_path / "anchors"
    conv = _conv("def pow(a, b):")

    def restart() -> Server:
        return Server(tmp_path, "--anchor-dir", str(folder))

    s = restart()
    try:
        a = _make_anchor(s, {"messages": conv})
        assert a["on_disk"]
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.log.read_text()
    path = folder / f"{a['id']}{FILE_SUFFIX}"
    assert path.is_file()

    s = restart()
    try:
        listed = _listed(s)
        assert listed[a["id"]]["on_disk"] and listed[a["id"]]["tier"] == "disk"
        assert listed[a["id"]]["tokens"] == a["tokens"] and listed[a["id"]]["checksum"] == a["checksum"]
        resp = _chat(s, conv, anchor=a["id"])
        assert _anchor_field(resp)["restored"] == a["id"] and _cached(resp) >= a["tokens"] - 1
        assert resp.choices[0].message.content == engine.answer(conv)
    finally:
        s.stop()

    _flip_a_kv_byte(path)
    s = restart()
    try:
        assert a["id"] in _listed(s)  # the anchor file is sound: the block files are checked at restore
        resp = _chat(s, conv, anchor=a["id"])
        field = _anchor_field(resp)
        assert field["restored"] is None and "checksum" in field["refused"], field
        assert _cached(resp) == 0 and resp.choices[0].message.content == engine.answer(conv)
    finally:
        s.stop()
