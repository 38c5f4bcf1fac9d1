"""A request body read and decoded as JSON with the limits a server facing any client needs, each a 4xx that names
what is wrong (never a 500, never the whole of an oversized body in memory):

* more than :data:`MAX_BODY_BYTES` bytes: 413, refused from its Content-Length, or as soon as the stream passes it;
* arrays and objects nested deeper than :data:`MAX_DEPTH`: 400, found by one vectorised pass over the bytes before
  anything parses the body recursively (Python's decoder and pydantic recurse once per level);
* a string that is not Unicode text (a lone surrogate escape such as ``"\\ud800"``, which JSON's grammar admits but no
  tokenizer takes): 400 naming the field where it stands.
"""

from __future__ import annotations

import json

import numpy as np

from freetoken.serve.errors import APIError

#: The largest request body read (an agent's 200k-token conversation with its tools is a few MiB)
MAX_BODY_BYTES = 32 << 20
#: The deepest nesting of arrays and objects taken (real requests stay under 20)
MAX_DEPTH = 256

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN = np.zeros(256, np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


async def read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body's bytes; a 413 past ``limit``, told by Content-Length or while the body streams in."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit >> 20} MiB", code="request_too_large")


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of ``[``/``{`` outside strings in ``raw`` (JSON text; malformed text gives some number,
    and the decoder then says what is wrong with it)."""
    b = np.frombuffer(raw, np.uint8)
    if b.size == 0:
        return 0
    # a quote is a string's edge unless an odd run of backslashes stands before it
    idx = np.arange(b.size)
    last_other = np.maximum.accumulate(np.where(b != _BACKSLASH, idx, -1))
    quotes = np.flatnonzero(b == _QUOTE)
    before = np.where(quotes > 0, last_other[np.maximum(quotes - 1, 0)], -1)
    run = np.where(quotes > 0, quotes - 1 - before, 0)
    edges = quotes[run % 2 == 0]
    toggles = np.zeros(b.size + 1, np.int32)
    toggles[edges + 1] = 1  # the byte after an opening quote is inside; after a closing one, outside
    inside = (np.cumsum(toggles[:-1]) % 2).astype(bool)
    step = _OPEN[b].astype(np.int32)
    step[inside] = 0
    return int(np.cumsum(step).max(initial=0))


def decode_json(raw: bytes, max_depth: int = MAX_DEPTH):
    """``raw`` as JSON, or a 400 naming the problem: bad JSON (line and column), nesting past ``max_depth``, a
    string with a lone surrogate (its field)."""
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise APIError(400, f"the request body nests arrays and objects {depth} deep; at most {max_depth} are taken",
                       code="invalid_json")
    try:
        data = json.loads(raw)
    except RecursionError:  # (not reached past the depth check; kept so no input can make a 500 here)
        raise APIError(400, "the request body nests too deeply", code="invalid_json") from None
    except ValueError as e:
        where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise APIError(400, f"the request body is not valid JSON{where}: {getattr(e, 'msg', e)}",
                       code="invalid_json") from None
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        where = lone_surrogate_path(data) or "body"
        raise APIError(400, f"{where}: the text has a lone surrogate escape (\\ud800-\\udfff without its pair), "
                       "which is not Unicode text", param=where, code="invalid_value") from None
    return data


def lone_surrogate_path(data, path: str = "") -> str | None:
    """Where the first string (or key) with a lone surrogate stands: ``messages.1.content``."""
    def bad(s: str) -> bool:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False

    if isinstance(data, str):
        return path if bad(data) else None
    if isinstance(data, dict):
        for k, v in data.items():
            here = f"{path}.{k}" if path else str(k)
            if bad(k):
                return here.encode("utf-8", "backslashreplace").decode()
            found = lone_surrogate_path(v, here)
            if found is not None:
                return found
    elif isinstance(data, list):
        for i, v in enumerate(data):
            found = lone_surrogate_path(v, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None
