"""OpenAI's error JSON, and the HTTP plumbing that answers with it.

``BadRequest`` names the request field at fault and becomes a 400 (or its own
status) with OpenAI's error object; ``json_errors`` is the aiohttp middleware
that gives every other error (aiohttp's own 404/405/413, a bug's 500) the same
shape; ``read_body`` bounds a body's size and the time it takes to arrive.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from tinyserve.serving.responses import SSE_DONE, sse


class BadRequest(Exception):
    """An invalid request body: becomes HTTP 400 (or ``status``) with OpenAI's error JSON."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def response(self) -> web.Response:
        response = error_response(self.message, self.param, self.status, self.kind)
        if self.status in (408, 413):       # the body was not read: the connection is spent
            response.force_close()
        return response


def error_body(message: str, param: str | None = None, status: int = 400,
               kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object (the body of an error response, or a streamed error)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(message: str, param: str | None = None, status: int = 400,
                   kind: str = "invalid_request_error", headers: dict | None = None) -> web.Response:
    return web.json_response(error_body(message, param, status, kind), status=status,
                             headers=headers)


def error_event(message: str, status: int = 500, kind: str = "internal_server_error") -> bytes:
    """A streamed error (what the ``openai`` SDK raises ``APIError`` on), then ``[DONE]``."""
    return sse(error_body(message, None, status, kind)) + SSE_DONE


ERROR_KINDS = {404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "invalid_request_error"}


def json_errors(max_request_bytes: int, log: logging.Logger):
    """aiohttp middleware: every error body is OpenAI's error JSON, aiohttp's own
    404/405/413 included, and a 500 (logged with its traceback) for a bug."""
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            headers = {k: v for k, v in exc.headers.items()
                       if k.lower() not in ("content-type", "content-length")}
            message = (f"request body too large (over {max_request_bytes} bytes)"
                       if exc.status == 413 else f"{exc.reason}: {request.method} {request.path}")
            return error_response(message, None, exc.status,
                                  ERROR_KINDS.get(exc.status, "invalid_request_error"), headers)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("internal error serving %s %s", request.method, request.path)
            return error_response("internal server error", None, 500, "internal_server_error")
    return middleware


if hasattr(asyncio, "timeout"):            # Python 3.11+: no inner task, no reference cycle
    _timeout = asyncio.timeout
else:                                       # pragma: no cover (Python 3.10)
    from async_timeout import timeout as _timeout


async def read_body(request: web.Request, timeout: float, max_bytes: int) -> bytes:
    """The whole body within ``timeout`` seconds (else 408) and ``max_bytes`` (else 413)."""
    # The BadRequest is raised outside the except clauses: chained to aiohttp's exception,
    # it would keep that exception's frames (and the partly read body) alive until a GC.
    problem = None
    try:
        async with _timeout(timeout):
            return await request.read()
    except asyncio.TimeoutError:
        problem = BadRequest(f"request body not received within {timeout:g} s", None, 408,
                             "timeout_error")
    except web.HTTPRequestEntityTooLarge:
        problem = BadRequest(f"request body too large (over {max_bytes} bytes)", None, 413)
    raise problem


def param_of(message: str) -> str | None:
    """Which request field an engine ``ValueError`` is about."""
    if message.startswith("prompt"):
        return "prompt"
    if message.startswith("request"):       # prompt + max_tokens do not fit the cache
        return "max_tokens"
    first = message.split(" ", 1)[0]
    return first if first in ("max_tokens", "temperature", "top_p", "top_k", "seed",
                              "logprobs") else None
