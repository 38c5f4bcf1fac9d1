"""Errors a request can get, as the OpenAI API writes them: ``{"error": {"message", "type", "param", "code"}}``, or
on the Anthropic endpoints (paths under :data:`ANTHROPIC_PREFIX`) as the Anthropic API does: ``{"type": "error",
"error": {"type", "message"}}``. The HTTP status is the same either way."""

from __future__ import annotations

from starlette.responses import JSONResponse

#: HTTP status -> the OpenAI error ``type``
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          413: "invalid_request_error", 503: "server_error", 500: "server_error"}
#: HTTP status -> the Anthropic error ``type`` (its API says 529 overloaded_error; a loading model is our 503)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}
#: Paths whose errors take the Anthropic shape (``/v1/messages``, ``/v1/messages/count_tokens``)
ANTHROPIC_PREFIX = "/v1/messages"


class APIError(Exception):
    """A request the server refuses: ``status`` and the OpenAI error body's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "invalid_request_error"),
                                           "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error as the API of ``path`` (the request's) writes it."""
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PREFIX) else self.body()
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's list of errors -> one 400 that names the first bad field (``messages.0.role``) and what is wrong.

    A field of several types (``stop``: a string or a list of strings) fails once per type, each error's place
    tagged with the type's name: the tags are dropped, and of such a group the errors about the value (a list too
    long, a part's missing field) win over the ones that only say the type was another."""
    if not errors:
        return APIError(400, "invalid request", code="invalid_value")
    clean = [(_param(e.get("loc", ())), e) for e in errors]
    about_value = [(p, e) for p, e in clean if not e.get("type", "").endswith("_type")]
    if about_value:  # the type it has is one the union allows: what is wrong is inside
        param, chosen = about_value[0][0], [about_value[0][1]]
    else:
        param = clean[0][0]
        chosen = [e for p, e in clean if p == param]
    message = ", or ".join(dict.fromkeys(e.get("msg", "invalid value") for e in chosen))
    others = len({p for p, _ in clean}) - 1
    if others:
        message += f" (and {others} more field{'s' if others > 1 else ''} with problems)"
    return APIError(400, f"{param}: {message}" if param else message, param=param or None, code="invalid_value")


def _param(loc) -> str:
    """``("messages", 0, "role")`` -> ``messages.0.role``, without pydantic's union tags (``str``, ``list[str]``,
    ``TextPart``, ``function-after[...]``) and the ``body`` prefix."""
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(str(p))
        elif p != "body" and not (any(c in p for c in "[]-") or p[:1].isupper()
                                  or p in ("str", "int", "float", "bool", "list", "dict", "none")):
            parts.append(p)
    return ".".join(parts)
