"""The error a request gets: an OpenAI-style error body with the field it names (`ApiError`), and one 400 for every
bad field of a pydantic validation (`validation_api_error`). Below every request model, so all of them can raise it."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class ApiError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body with this status code."""

    def __init__(self, message: str, *, param: str | None = None, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code

    @property
    def error_type(self) -> str:
        """The error's `type`, as vLLM names it."""
        return {
            400: "BadRequestError",
            401: "AuthenticationError",
            404: "NotFoundError",
            413: "RequestTooLargeError",
            504: "TimeoutError",
        }.get(self.status_code, "InternalServerError")

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {message, type, param, code}}` (what the `openai` client parses)."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status_code,
            }
        }


def validation_api_error(err: ValidationError) -> ApiError:
    """One 400 naming every bad field and its value (`messages.0.role: ... (got 'x')`)."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<body>"
        got = f" (got {_short_repr(e['input'])})" if "input" in e and e["type"] != "missing" else ""
        lines.append(f"{path}: {e['msg']}{got}")
    first = err.errors()[0]["loc"] if err.errors() else ()
    return ApiError("invalid request: " + "; ".join(lines), param=".".join(str(p) for p in first) or None)


def _short_repr(value: Any, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters (a refused value may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
