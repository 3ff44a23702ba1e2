"""OpenAI request bodies, parsed and validated into engine arguments.

``parse_request`` turns a ``/v1/completions`` or ``/v1/chat/completions`` body
into a ``ParsedRequest`` without tokenizing it; ``BadRequest`` names the field
at fault. Every parameter is either implemented, accepted only at the value that
means "off" (``frequency_penalty: 0``, ``echo: false``, ...), or rejected with a
400 that names it: a request is never answered as if a parameter had been
applied when it was not.

Chat: a checkpoint that ships a ``chat_template`` (``tokenizer_config.json``)
is prompted through it, as ``transformers``' ``apply_chat_template`` renders it
(``chat_renderer``). Without one (the shipped models were trained on plain
text) every message becomes ``"{role}: {content}\\n"`` and the prompt ends with
``"assistant: "``, e.g. ``[{"role": "user", "content": "你好"}]`` becomes
``"user: 你好\\nassistant: "``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from tinyserve.request import MAX_LOGPROBS, SamplingParams
from tinyserve.serving.errors import BadRequest

CHAT_ROLES = ("system", "user", "assistant")
DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 64
MAX_N = 16                       # choices per request
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256             # characters per stop string


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


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def decode_json(raw: bytes) -> Any:
    """A request body's JSON; ``BadRequest`` if it is not JSON (NaN and Infinity are
    not), or nested too deeply to decode. The 400 names the top-level field whose
    value is at fault (``{"temperature": NaN}``: ``temperature``) when there is one."""
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        problem = "request body is nested too deeply"
    except (ValueError, UnicodeDecodeError) as exc:
        problem = f"request body is not valid JSON: {exc}"
    # Raised outside the except clauses, so that it does not carry the decode error along.
    field_ = _field_at_fault(raw)
    raise BadRequest(problem if field_ is None else f"{problem} (in {field_})", field_)


_WHITESPACE = re.compile(r"[ \t\n\r]*")      # JSON's four whitespace characters


def _field_at_fault(raw: bytes) -> str | None:
    """The key of the top-level member whose value does not decode, for a body that
    is an object up to there; None otherwise. Run only once decoding has failed: the
    members are decoded again one at a time, and the first that fails is the culprit."""
    try:
        text = raw.decode(json.detect_encoding(raw))
    except UnicodeDecodeError:
        return None
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    at = _WHITESPACE.match(text).end()
    if not text.startswith("{", at):
        return None
    sep = "{"
    while text.startswith(sep, at):
        at = _WHITESPACE.match(text, at + 1).end()
        try:
            key, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        at = _WHITESPACE.match(text, at).end()
        if not isinstance(key, str) or not text.startswith(":", at):
            return None
        try:
            _, at = decoder.raw_decode(text, _WHITESPACE.match(text, at + 1).end())
        except (ValueError, RecursionError):
            return key
        at, sep = _WHITESPACE.match(text, at).end(), ","
    return None


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
        raise BadRequest(f"{name} must be {what}, got {_short(value)}", name)
    return value


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# Parameters implemented (both endpoints, then each one's own).
SUPPORTED = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
             "stop_token_ids", "ignore_eos", "stream", "stream_options", "n", "logprobs",
             "return_token_ids", "user"}
SUPPORTED_COMPLETION = {"prompt", "best_of", "echo", "suffix"}
SUPPORTED_CHAT = {"messages", "max_completion_tokens", "top_logprobs"}
# Not implemented, but accepted at the value that means "off" (what leaving them out
# means): anything else gets a 400 that names the parameter.
NEUTRAL = {
    "frequency_penalty": lambda v: v == 0,
    "presence_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1,
    "min_tokens": lambda v: v == 0,
    "logit_bias": lambda v: v == {},
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "parallel_tool_calls": lambda v: isinstance(v, bool),   # only matters with tools
    "response_format": lambda v: v == {"type": "text"},
    "store": lambda v: v is False,
    "metadata": lambda v: isinstance(v, dict),               # labels, no effect on output
    "skip_special_tokens": lambda v: v is True,
    "include_stop_str_in_output": lambda v: v is False,
}


def check_parameters(body: dict, chat: bool) -> None:
    """400 naming the first parameter that is neither implemented nor at its "off" value."""
    own = SUPPORTED_CHAT if chat else SUPPORTED_COMPLETION
    for name, value in body.items():
        if name in SUPPORTED or name in own or value is None:
            continue
        check = NEUTRAL.get(name)
        if check is None:
            raise BadRequest(f"{name} is not supported by this server (tinyserve)", name)
        try:
            ok = check(value)
        except Exception:
            ok = False
        if not ok:
            raise BadRequest(f"{name}={_short(value, 40)} is not supported by this server "
                             "(tinyserve); leave it out or send its default", name)


@dataclass
class ParsedRequest:
    prompt: str | list[int] | None          # /v1/completions
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    chat: bool
    messages: list[dict] | None = None      # /v1/chat/completions
    n: int = 1
    stop: list[str] = field(default_factory=list)
    max_tokens_given: bool = True           # False: the default, cut to what fits
    max_tokens_field: str = "max_tokens"    # as the client sent it (chat: max_completion_tokens)

    def choice_params(self, index: int) -> SamplingParams:
        """Choice ``index``'s params: choice i > 0 of a seeded request draws with seed + i."""
        p = self.params
        if index == 0 or p.seed is None:
            return p
        return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                              top_k=p.top_k, seed=p.seed + index, ignore_eos=p.ignore_eos,
                              stop_token_ids=p.stop_token_ids, logprobs=p.logprobs)


def parse_request(body: Any, chat: bool, model_name: str, max_prompt_chars: int | None = None,
                  max_model_len: int | None = None) -> ParsedRequest:
    """Validate an OpenAI request body, without tokenizing; raise ``BadRequest`` naming
    the field. A text prompt (or messages) longer than ``max_prompt_chars`` characters,
    or a token-id prompt of ``max_model_len`` ids or more, is rejected here, before any
    tokenizer sees it."""
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"model {_short(model)} does not exist; this server serves "
                         f"{model_name!r}", "model", status=404, kind="not_found_error")
    check_parameters(body, chat)
    if chat:
        messages, prompt = parse_messages(body.get("messages")), None
        _check_chars("messages", sum(len(m["content"]) for m in messages), max_prompt_chars)
    else:
        messages, prompt = None, _parse_prompt(body)
        if isinstance(prompt, str):
            _check_chars("prompt", len(prompt), max_prompt_chars)
        elif max_model_len is not None and len(prompt) >= max_model_len:
            raise BadRequest(f"prompt is {len(prompt)} tokens; this model's maximum context "
                             f"length is {max_model_len} tokens, which leaves no room for "
                             "output", "prompt")
    params, given, max_tokens_field = _parse_sampling(body, chat)
    stream = _get(body, "stream", _is_bool, "a boolean", False)
    n = _get(body, "n", lambda v: _is_int(v) and 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]", 1)
    if not chat:
        _get(body, "best_of", lambda v: v == n, f"equal to n ({n}): best_of is not supported", n)
        _get(body, "echo", lambda v: v is False, "false: echo is not supported", False)
        _get(body, "suffix", lambda v: v == "", "empty: suffix is not supported", "")
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest(f"stream_options.include_usage must be a boolean, got {include_usage!r}",
                         "stream_options")
    return_ids = _get(body, "return_token_ids", _is_bool, "a boolean", False)
    return ParsedRequest(prompt, params, stream, include_usage and stream, return_ids, chat,
                         messages=messages, n=n, stop=_parse_stop(body), max_tokens_given=given,
                         max_tokens_field=max_tokens_field)


def _check_chars(field_: str, chars: int, limit: int | None) -> None:
    if limit is not None and chars > limit:
        raise BadRequest(f"{field_} is {chars} characters: too long for the model's context "
                         f"(at most {limit} characters are accepted)", field_)


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


def _parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops)):
        raise BadRequest(f"stop must be a non-empty string or a list of at most "
                         f"{MAX_STOP_STRINGS} of them, each at most {MAX_STOP_CHARS} "
                         f"characters; got {_short(stop)}", "stop")
    return list(dict.fromkeys(stops))


def _parse_logprobs(body: dict, chat: bool) -> int | None:
    """Completions: ``logprobs`` is how many top tokens to list (0-20). Chat: ``logprobs``
    is a boolean and ``top_logprobs`` (0-20) the count, which needs ``logprobs``."""
    what = f"an integer in [0, {MAX_LOGPROBS}]"
    top_ok = lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS  # noqa: E731
    if not chat:
        return _get(body, "logprobs", top_ok, what, None)
    on = _get(body, "logprobs", _is_bool, "a boolean", False)
    top = _get(body, "top_logprobs", top_ok, what, None)
    if top is not None and not on:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if on else None


def _parse_sampling(body: dict, chat: bool) -> tuple[SamplingParams, bool, str]:
    """The sampling params, whether ``max_tokens`` was given (not the default), and the
    field it came in (chat also takes OpenAI's newer ``max_completion_tokens``)."""
    name = "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is None and chat and body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
        max_tokens = body[name]
    given = max_tokens is not None
    if not given:
        max_tokens = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"{name} must be an integer >= 1, got {_short(max_tokens)}", name)
    temperature = _get(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2,
                       "a number in [0, 2]", 1.0)
    top_p = _get(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
    top_k = _get(body, "top_k", lambda v: _is_int(v) and (v == -1 or v >= 1),
                 "-1 (no limit) or an integer >= 1", -1)
    # Any integer: SamplingParams reduces it modulo 2**64 (torch's generator is 64-bit).
    seed = _get(body, "seed", _is_int, "an integer", None)
    stop_ids = _get(body, "stop_token_ids",
                    lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                    "a list of integers", None)
    ignore_eos = _get(body, "ignore_eos", _is_bool, "a boolean", False)
    params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                            top_p=float(top_p), top_k=top_k, seed=seed, ignore_eos=ignore_eos,
                            stop_token_ids=stop_ids, logprobs=_parse_logprobs(body, chat))
    return params, given, name


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


def check_context(parsed: ParsedRequest, num_prompt_tokens: int, max_model_len: int) -> None:
    """As vLLM: a prompt longer than the context is a 400 (``prompt``), and so is an
    explicit ``max_tokens`` that does not fit after it (``max_tokens``). The default
    ``max_tokens`` is cut to what fits instead."""
    field_ = "messages" if parsed.chat else "prompt"
    if num_prompt_tokens >= max_model_len:
        raise BadRequest(f"{field_} is {num_prompt_tokens} tokens; this model's maximum "
                         f"context length is {max_model_len} tokens, which leaves no room "
                         "for output", field_)
    room = max_model_len - num_prompt_tokens
    p = parsed.params
    if p.max_tokens > room:
        if parsed.max_tokens_given:
            raise BadRequest(f"this model's maximum context length is {max_model_len} tokens; "
                             f"you asked for {num_prompt_tokens} in the {field_} and "
                             f"{p.max_tokens} for the completion ({parsed.max_tokens_field})",
                             parsed.max_tokens_field)
        parsed.params = SamplingParams(max_tokens=room, temperature=p.temperature, top_p=p.top_p,
                                       top_k=p.top_k, seed=p.seed, ignore_eos=p.ignore_eos,
                                       stop_token_ids=p.stop_token_ids, logprobs=p.logprobs)
