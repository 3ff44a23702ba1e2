"""Pure builders of OpenAI response bodies and streamed chunks: a whole response
(``completion_body`` of ``whole_choice``s), and server-sent events
``data: {json}\\n\\n`` (``sse``) of ``completion_chunk``s ending with ``SSE_DONE``."""

from __future__ import annotations

import json

SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def whole_choice(index: int, chat: bool, text: str, finish: str | None,
                 token_ids: list[int] | None = None, logprobs: dict | None = None) -> dict:
    """One choice of a whole (non-streamed) response."""
    if chat:
        choice = {"index": index, "message": {"role": "assistant", "content": text},
                  "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def completion_body(rid: str, created: int, model: str, chat: bool, choices: list[dict],
                    usage_: dict) -> dict:
    """A whole (non-streamed) response."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": usage_}


def chunk_choice(index: int, chat: bool, text: str, finish: str | None,
                 token_ids: list[int] | None, first: bool, logprobs: dict | None = None) -> dict:
    """One choice of a streamed chunk (a choice's first chat chunk also carries the role)."""
    if chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def completion_chunk(rid: str, created: int, model: str, chat: bool, choices: list[dict]) -> dict:
    """One streamed chunk."""
    return {"id": rid, "object": _chunk_object(chat), "created": created, "model": model,
            "choices": choices}


def usage_chunk(rid: str, created: int, model: str, chat: bool, usage_: dict) -> dict:
    """The last streamed chunk when ``stream_options.include_usage`` is set."""
    return {"id": rid, "object": _chunk_object(chat), "created": created, "model": model,
            "choices": [], "usage": usage_}


def _chunk_object(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


def sse(data: dict) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"
