"""The OpenAI request and response format, as ``tinyserve.serving.app`` speaks it.

Parsing and validating request bodies into engine arguments (``parse_request``;
``BadRequest`` names the field at fault), the error JSON (``error_response``),
the chat template, and the pure builders of response bodies and streamed
chunks (server-sent events ``data: {json}\\n\\n`` ending with ``SSE_DONE``).

Chat: a checkpoint that ships a ``chat_template`` (``tokenizer_config.json``)
is prompted through it, as ``transformers``' ``apply_chat_template`` renders it
(``chat_renderer``). Without one (the shipped models were trained on plain
text) every message becomes ``"{role}: {content}\\n"`` and the prompt ends with
``"assistant: "``, e.g. ``[{"role": "user", "content": "你好"}]`` becomes
``"user: 你好\\nassistant: "``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from tinyserve.request import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")
DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 64
SSE_DONE = b"data: [DONE]\n\n"


def render_chat(messages: list[dict]) -> str:
    """The plain-text chat format: ``role: content`` lines, then ``assistant: ``."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def chat_renderer(tokenizer) -> Callable[[list[dict]], str | list[int]]:
    """How a server with ``tokenizer`` turns chat messages into a prompt: the
    checkpoint's own template, as token ids (the template writes its special tokens
    itself, so none are added), or the plain-text format when it has no template."""
    if getattr(tokenizer, "chat_template", None) is None:
        return render_chat

    def render(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return render


# ---- errors ------------------------------------------------------------------------

class BadRequest(Exception):
    """An invalid request body: becomes HTTP 400 with OpenAI's error JSON."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def response(self) -> web.Response:
        return error_response(self.message, self.param, self.status, self.kind)


def error_body(message: str, param: str | None = None, status: int = 400,
               kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object (the body of an error response, or a streamed error)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(message: str, param: str | None = None, status: int = 400,
                   kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(error_body(message, param, status, kind), status=status)


def param_of(message: str) -> str | None:
    """Which request field an engine ``ValueError`` is about."""
    if message.startswith("prompt"):
        return "prompt"
    if message.startswith("request"):       # prompt + max_tokens do not fit the cache
        return "max_tokens"
    first = message.split(" ", 1)[0]
    return first if first in ("max_tokens", "temperature", "top_p", "top_k", "seed") else None


# ---- request validation ------------------------------------------------------------

def decode_json(raw: bytes) -> Any:
    """A request body's JSON; ``BadRequest`` if it is not JSON."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _get(body: dict, name: str, check: Callable[[Any], bool], what: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise BadRequest(f"{name} must be {what}, got {value!r}", name)
    return value


@dataclass
class ParsedRequest:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    chat: bool


def parse_request(body: Any, chat: bool, model_name: str,
                  render: Callable[[list[dict]], str | list[int]] = render_chat) -> ParsedRequest:
    """Validate an OpenAI request body; raise ``BadRequest`` naming the field.
    ``render`` turns chat messages into the prompt (``chat_renderer``)."""
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"model {model!r} does not exist; this server serves {model_name!r}",
                         "model", status=404, kind="not_found_error")
    prompt = render(parse_messages(body.get("messages"))) if chat else _parse_prompt(body)
    params = _parse_sampling(body, chat)
    stream = _get(body, "stream", _is_bool, "a boolean", False)
    n = _get(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise BadRequest(f"n must be 1 (one completion per request), got {n!r}", "n")
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest(f"stream_options.include_usage must be a boolean, got {include_usage!r}",
                         "stream_options")
    return_ids = _get(body, "return_token_ids", _is_bool, "a boolean", False)
    return ParsedRequest(prompt, params, stream, include_usage and stream, return_ids, chat)


def _parse_prompt(body: dict) -> str | list[int]:
    """``prompt`` of a /v1/completions body: a non-empty string or list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]              # a batch of one, as some clients send it
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
    elif isinstance(prompt, list):
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        if not all(_is_int(t) for t in prompt):
            raise BadRequest("prompt must be a string or a list of token ids (integers)",
                             "prompt")
    else:
        raise BadRequest("prompt must be a string or a list of token ids, got "
                         f"{type(prompt).__name__}", "prompt")
    return prompt


def _parse_sampling(body: dict, chat: bool) -> SamplingParams:
    max_tokens = body.get("max_tokens")
    if max_tokens is None and chat:
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    temperature = _get(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2,
                       "a number in [0, 2]", 1.0)
    top_p = _get(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
    top_k = _get(body, "top_k", lambda v: _is_int(v) and (v == -1 or v >= 1),
                 "-1 (no limit) or an integer >= 1", -1)
    seed = _get(body, "seed", _is_int, "an integer", None)
    stop_ids = _get(body, "stop_token_ids",
                    lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                    "a list of integers", None)
    ignore_eos = _get(body, "ignore_eos", _is_bool, "a boolean", False)
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                          top_p=float(top_p), top_k=top_k, seed=seed, ignore_eos=ignore_eos,
                          stop_token_ids=stop_ids)


def parse_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {list(CHAT_ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):       # OpenAI's content parts: keep the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"messages[{i}].content parts must be text parts", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out


# ---- responses ---------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, created: int, model: str, chat: bool, text: str,
                    finish: str | None, token_ids: list[int] | None, usage_: dict) -> dict:
    """A whole (non-streamed) response."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice], "usage": usage_}


def completion_chunk(rid: str, created: int, model: str, chat: bool, text: str,
                     finish: str | None, token_ids: list[int] | None, first: bool) -> dict:
    """One streamed chunk (the first chat chunk also carries the role)."""
    if chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": _chunk_object(chat), "created": created, "model": model,
            "choices": [choice]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, usage_: dict) -> dict:
    """The last streamed chunk when ``stream_options.include_usage`` is set."""
    return {"id": rid, "object": _chunk_object(chat), "created": created, "model": model,
            "choices": [], "usage": usage_}


def _chunk_object(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


def sse(data: dict) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"
