"""An OpenAI-compatible streaming HTTP server in front of one ``LLMEngine``.

    tinyserve serve --model tiny-zh --host 127.0.0.1 --port 8000
    python -m tinyserve serve --model tiny --port 8001 --max-num-seqs 16

Two threads, two jobs. The aiohttp event loop parses requests and writes
responses; one dedicated *engine thread* owns the ``LLMEngine`` and does
nothing but ``step()``. They meet in a thread-safe inbox (add / abort / call
commands) going in, and ``loop.call_soon_threadsafe`` pushing each step's new
tokens into a per-request ``asyncio.Queue`` coming out. The engine thread
sleeps on a condition variable while it has nothing to do, so an idle server
uses no CPU. Because only the engine thread touches the engine, the scheduler
and the block manager need no locks.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions``
(``stream`` true/false; streamed as server-sent events ``data: {json}\\n\\n``
ending with ``data: [DONE]\\n\\n``), ``GET /health``, ``GET /v1/models``,
``GET /metrics`` (Prometheus text) and ``GET /debug/engine`` (block accounting,
checked on the engine thread).

Chat template (the shipped models were trained on plain text, so it is plain
text too): every message becomes ``"{role}: {content}\\n"`` and the prompt ends
with ``"assistant: "``, e.g. ``[{"role": "user", "content": "你好"}]`` becomes
``"user: 你好\\nassistant: "``.

A client that disconnects aborts its request: aiohttp cancels the handler,
whose ``finally`` posts an abort that the engine thread applies before its
next step, which frees the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from tinyserve.engine import LLM, LLMEngine, RequestOutput
from tinyserve.request import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")
DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 64


def render_chat(messages: list[dict]) -> str:
    """The chat template: ``role: content`` lines, then ``assistant: `` (see module doc)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


# ---- request validation ------------------------------------------------------------

class BadRequest(Exception):
    """An invalid request body: becomes HTTP 400 with OpenAI's error JSON."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def response(self) -> web.Response:
        return error_response(self.message, self.param, self.status, self.kind)


def error_response(message: str, param: str | None = None, status: int = 400,
                   kind: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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


def parse_request(body: Any, chat: bool, model_name: str) -> ParsedRequest:
    """Validate an OpenAI request body; raise ``BadRequest`` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"model {model!r} does not exist; this server serves {model_name!r}",
                         "model", status=404, kind="not_found_error")
    if chat:
        prompt = render_chat(parse_messages(body.get("messages")))
    else:
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
    default_max = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_MAX_TOKENS
    max_tokens = body.get("max_tokens")
    if max_tokens is None and chat:
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = default_max
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
    ignore_eos = _get(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False)
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    n = _get(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise BadRequest(f"n must be 1 (one completion per request), got {n!r}", "n")
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest(f"stream_options.include_usage must be a boolean, got {include_usage!r}",
                         "stream_options")
    return_ids = _get(body, "return_token_ids", lambda v: isinstance(v, bool), "a boolean", False)
    params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                            top_p=float(top_p), top_k=top_k, seed=seed, ignore_eos=ignore_eos,
                            stop_token_ids=stop_ids)
    return ParsedRequest(prompt, params, stream, include_usage and stream, return_ids, chat)


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


def param_of(message: str) -> str | None:
    """Which request field an engine ``ValueError`` is about."""
    if message.startswith("prompt"):
        return "prompt"
    if message.startswith("request"):       # prompt + max_tokens do not fit the cache
        return "max_tokens"
    first = message.split(" ", 1)[0]
    return first if first in ("max_tokens", "temperature", "top_p", "top_k", "seed") else None


# ---- the engine thread -------------------------------------------------------------

@dataclass
class Delta:
    """What one engine step produced for one request (sent to its handler)."""
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int


class EngineError(Exception):
    """The engine thread failed while running a request."""


class RequestHandle:
    def __init__(self, request_id: str, queue: asyncio.Queue):
        self.request_id = request_id
        self.queue = queue
        self.finished = False


class EngineLoop:
    """Owns an ``LLMEngine`` on one dedicated thread; handlers talk to it via an inbox."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: deque[tuple] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # request_id -> (event loop, queue); touched only by the engine thread.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Counters for /metrics (written by the engine thread only).
        self.num_steps = 0
        self.request_success_total = 0
        self.request_abort_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- lifecycle --
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tinyserve-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _post(self, command: tuple) -> None:
        with self._wake:
            self._inbox.append(command)
            self._wake.notify()

    # -- called from the event loop --
    async def add(self, prompt, params: SamplingParams) -> RequestHandle:
        """Queue a request; raise ``ValueError`` if the engine rejects it."""
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        queue: asyncio.Queue = asyncio.Queue()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        self._post(("add", request_id, prompt, params, loop, queue, accepted))
        try:
            await accepted
        except asyncio.CancelledError:      # the client left before the engine took it
            self.abort(request_id)
            raise
        return RequestHandle(request_id, queue)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread (a consistent snapshot)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._post(("call", fn, loop, done))
        return await done

    # -- the engine thread --
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not (self._inbox or self._stopping or engine.has_unfinished_requests()):
                    self._wake.wait()           # idle: sleep until a command arrives
                if self._stopping:
                    break
                commands = list(self._inbox)
                self._inbox.clear()
            for command in commands:
                self._apply(command)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:            # keep serving: fail what was running
                self._fail_all(exc)
                continue
            self.num_steps += 1
            self._deliver(outputs)
        self._fail_all(EngineError("server is shutting down"))

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, loop, queue, accepted = command
            try:
                self.engine.add_request(prompt, params, request_id=request_id)
            except ValueError as exc:
                _resolve(loop, accepted, exc=exc)
                return
            self._streams[request_id] = (loop, queue)
            _resolve(loop, accepted, result=request_id)
        elif kind == "abort":
            request_id = command[1]
            if self._streams.pop(request_id, None) is not None and self.engine.abort(request_id):
                self.request_abort_total += 1
        elif kind == "call":
            _, fn, loop, done = command
            try:
                result = fn(self.engine)
            except Exception as exc:
                _resolve(loop, done, exc=exc)
            else:
                _resolve(loop, done, result=result)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One call_soon_threadsafe per event loop per step, not one per token.
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            self.generation_tokens_total += len(out.new_token_ids)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self.prompt_tokens_total += len(out.prompt_token_ids)
                if out.finish_reason in ("stop", "length"):
                    self.request_success_total += 1
            if stream is None:
                continue
            loop, queue = stream
            delta = Delta(out.new_text, list(out.new_token_ids), out.finished, out.finish_reason,
                          len(out.prompt_token_ids), out.num_output_tokens)
            batches.setdefault(loop, []).append((queue, delta))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):      # the loop has closed (shutdown)
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, (loop, queue) in list(self._streams.items()):
            with contextlib.suppress(Exception):
                self.engine.abort(request_id)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, EngineError(str(exc)))
        self._streams.clear()


def _put_all(items: list) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result=None, exc=None):
    def settle():
        if not future.done():
            future.set_exception(exc) if exc is not None else future.set_result(result)
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)


# ---- HTTP --------------------------------------------------------------------------

ENGINE_KEY = web.AppKey("engine_loop", EngineLoop)
SERVER_STEP_STATS_WINDOW = 256
MODEL_KEY = web.AppKey("model_name", str)


def engine_snapshot(engine: LLMEngine, check: bool = False) -> dict:
    bm = engine.block_manager
    snap = {"num_waiting": engine.num_waiting, "num_running": engine.num_running,
            "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
            "num_cached_free_blocks": bm.num_cached_free_blocks, "kv_cache_usage": bm.usage,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "prefix_cache_queries": bm.num_queried_tokens, "prefix_cache_hits": bm.num_hit_tokens}
    if check:
        try:
            bm.check_integrity()
            snap["integrity"] = "ok"
        except AssertionError as exc:
            snap["integrity"] = str(exc)
    return snap


async def _read_json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


def _chunk(rid: str, created: int, model: str, chat: bool, text: str, finish: str | None,
           token_ids: list[int] | None, first: bool) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}


def _sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


async def _next_delta(handle: RequestHandle) -> Delta:
    item = await handle.queue.get()
    if isinstance(item, EngineError):
        raise item
    if item.finished:
        handle.finished = True
    return item


async def _completion(request: web.Request, chat: bool) -> web.StreamResponse:
    loop_ = request.app[ENGINE_KEY]
    model = request.app[MODEL_KEY]
    try:
        parsed = parse_request(await _read_json(request), chat, model)
        handle = await loop_.add(parsed.prompt, parsed.params)
    except BadRequest as exc:
        return exc.response()
    except ValueError as exc:
        return error_response(str(exc), param_of(str(exc)))
    rid = ("chatcmpl-" if chat else "cmpl-") + handle.request_id.split("-", 1)[1]
    created = int(time.time())
    try:
        if parsed.stream:
            return await _stream(request, handle, parsed, rid, created, model)
        text, ids = [], []
        while not handle.finished:
            delta = await _next_delta(handle)
            text.append(delta.text)
            ids.extend(delta.token_ids)
        usage = {"prompt_tokens": delta.num_prompt_tokens,
                 "completion_tokens": delta.num_output_tokens,
                 "total_tokens": delta.num_prompt_tokens + delta.num_output_tokens}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                      "logprobs": None, "finish_reason": delta.finish_reason}
        else:
            choice = {"index": 0, "text": "".join(text), "logprobs": None,
                      "finish_reason": delta.finish_reason}
        if parsed.return_token_ids:
            choice["token_ids"] = ids
        return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": model, "choices": [choice],
                                  "usage": usage})
    except EngineError as exc:
        return error_response(str(exc), status=500, kind="internal_server_error")
    finally:
        if not handle.finished:             # client went away (or we failed): free its blocks
            loop_.abort(handle.request_id)


async def _stream(request, handle, parsed, rid, created, model) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    first = True
    try:
        while not handle.finished:
            delta = await _next_delta(handle)
            ids = delta.token_ids if parsed.return_token_ids else None
            await response.write(_sse(_chunk(rid, created, model, parsed.chat, delta.text,
                                             delta.finish_reason, ids, first)))
            first = False
    except EngineError as exc:
        await response.write(_sse({"error": {"message": str(exc), "type": "internal_server_error",
                                             "param": None, "code": 500}}))
    else:
        if parsed.include_usage:
            usage = {"prompt_tokens": delta.num_prompt_tokens,
                     "completion_tokens": delta.num_output_tokens,
                     "total_tokens": delta.num_prompt_tokens + delta.num_output_tokens}
            await response.write(_sse({"id": rid, "object": "chat.completion.chunk" if parsed.chat
                                       else "text_completion", "created": created, "model": model,
                                       "choices": [], "usage": usage}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


async def health(request: web.Request) -> web.Response:
    if not request.app[ENGINE_KEY].alive:
        return web.json_response({"status": "engine stopped"}, status=503)
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    name = request.app[MODEL_KEY]
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "tinyserve"}]})


async def debug_engine(request: web.Request) -> web.Response:
    loop_ = request.app[ENGINE_KEY]
    snap = await loop_.call(lambda e: engine_snapshot(e, check=True))
    snap.update(num_steps=loop_.num_steps, request_success_total=loop_.request_success_total,
                request_abort_total=loop_.request_abort_total)
    return web.json_response(snap)


# name, type, help, value key
METRICS = [
    ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", "num_waiting"),
    ("num_requests_running", "gauge", "Requests in the running batch.", "num_running"),
    ("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks held by requests (0-1).",
     "kv_cache_usage"),
    ("kv_cache_free_blocks", "gauge", "KV-cache blocks nobody holds (cached ones included).",
     "num_free_blocks"),
    ("kv_cache_num_blocks", "gauge", "KV-cache blocks in total.", "num_blocks"),
    ("prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache / looked up.",
     "prefix_cache_hit_rate"),
    ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
     "prefix_cache_hits"),
    ("request_success_total", "counter", "Requests finished by stop or length.",
     "request_success_total"),
    ("request_abort_total", "counter", "Requests aborted (client disconnected).",
     "request_abort_total"),
    ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", "prompt_tokens_total"),
    ("generation_tokens_total", "counter", "Output tokens generated.", "generation_tokens_total"),
]


def prometheus_text(values: dict, model: str, prefix: str = "tinyserve:") -> str:
    lines = []
    for name, kind, help_text, key in METRICS:
        lines += [f"# HELP {prefix}{name} {help_text}", f"# TYPE {prefix}{name} {kind}",
                  f'{prefix}{name}{{model_name="{model}"}} {float(values[key])!r}']
    return "\n".join(lines) + "\n"


async def metrics(request: web.Request) -> web.Response:
    loop_ = request.app[ENGINE_KEY]
    values = await loop_.call(engine_snapshot)
    values.update(request_success_total=loop_.request_success_total,
                  request_abort_total=loop_.request_abort_total,
                  prompt_tokens_total=loop_.prompt_tokens_total,
                  generation_tokens_total=loop_.generation_tokens_total)
    return web.Response(text=prometheus_text(values, request.app[MODEL_KEY]),
                        content_type="text/plain", charset="utf-8")


def parse_prometheus(text: str) -> dict[str, float]:
    """``{metric name: value}`` from Prometheus text (labels dropped; last sample wins)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        out[name_labels.split("{", 1)[0]] = float(value)
    return out


def build_app(engine: LLMEngine, model_name: str) -> web.Application:
    """The aiohttp app; the engine thread starts and stops with it."""
    app = web.Application(client_max_size=16 * 2**20)
    loop_ = EngineLoop(engine)
    app[ENGINE_KEY] = loop_
    app[MODEL_KEY] = model_name

    async def start_engine(app):
        loop_.start()

    async def stop_engine(app):
        await asyncio.get_running_loop().run_in_executor(None, loop_.stop)

    app.on_startup.append(start_engine)
    app.on_shutdown.append(stop_engine)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/engine", debug_engine)
    return app


def serve(model: str = "tiny-zh", host: str = "127.0.0.1", port: int = 8000,
          served_model_name: str | None = None, threads: int | None = None, **llm_kwargs) -> None:
    """Load the model, then serve until SIGINT/SIGTERM (which also stop the engine thread)."""
    if threads:
        import torch
        torch.set_num_threads(threads)
    # A long-lived server keeps counters for /metrics, not a history of every step.
    llm = LLM(model=model, step_stats_window=SERVER_STEP_STATS_WINDOW, **llm_kwargs)
    app = build_app(llm.engine, served_model_name or model)
    print(f"tinyserve: serving {model!r} on http://{host}:{port} "
          f"({llm.engine.block_manager.num_blocks} KV blocks)", flush=True)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts.
    web.run_app(app, host=host, port=port, handler_cancellation=True, print=None,
                access_log=None, shutdown_timeout=5.0)


# ---- running servers as subprocesses (tests, notebooks, the router benchmark) -------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 120.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server process exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy within {timeout} s")


class ServerProcess:
    """A ``python -m tinyserve <command>`` subprocess on a free loopback port.

    Use as a context manager (or call ``stop()``) so that it never outlives you.
    """

    def __init__(self, args: list[str], host: str = "127.0.0.1", port: int | None = None):
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        cmd = [sys.executable, "-m", "tinyserve", *args, "--host", host, "--port", str(self.port)]
        # stderr goes to a file, not a pipe: a pipe nobody reads can fill up and block it.
        self._stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._stderr,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait(self, timeout: float = 120.0) -> "ServerProcess":
        try:
            wait_healthy(self.url, timeout, self.process)
        except Exception:
            err = self.stop()
            raise RuntimeError(f"{self.url} failed to start: {err[-2000:]}") from None
        return self

    def stop(self, timeout: float = 10.0) -> str:
        """SIGTERM, then SIGKILL if needed; returns what it wrote to stderr."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._stderr.closed:
            return ""
        self._stderr.seek(0)
        err = self._stderr.read()
        self._stderr.close()
        return err.decode(errors="replace")

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_servers(n: int, model: str = "tiny", extra_args: list[str] | None = None,
                   timeout: float = 120.0) -> list[ServerProcess]:
    """Start ``n`` servers at once and wait until all are healthy (all stopped on failure)."""
    procs = [ServerProcess(["serve", "--model", model, *(extra_args or [])]) for _ in range(n)]
    try:
        for p in procs:
            p.wait(timeout)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs
