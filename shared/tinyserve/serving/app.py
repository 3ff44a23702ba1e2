"""An OpenAI-compatible streaming HTTP server in front of one ``LLMEngine``.

    tinyserve serve --model tiny-zh --host 127.0.0.1 --port 8000
    python -m tinyserve serve --model tiny --port 8001 --max-num-seqs 16

Three threads, three jobs: the aiohttp event loop runs the handlers here, one
tokenizer thread turns prompts into token ids, and one engine thread
(``tinyserve.serving.engine_loop.EngineLoop``) owns the engine. OpenAI's format
is in ``request_parsing`` (bodies in), ``responses`` (bodies and chunks out),
``stops_and_logprobs`` and ``errors``, beside this module.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions``
(``stream`` true/false; streamed as server-sent events ``data: {json}\\n\\n``
ending with ``data: [DONE]\\n\\n``; ``n``, ``stop``, ``logprobs``), ``GET /health``,
``GET /v1/models``, ``GET /metrics`` (Prometheus text) and ``GET /debug/engine``
(block accounting, checked on the engine thread).

Bounded work per request, before the engine sees it: the body is at most
``max_request_bytes`` (413) and must arrive within ``body_timeout`` seconds (408);
the request head within ``header_timeout`` (the connection is closed); a prompt
longer than ``max_prompt_chars`` characters is a 400 without being tokenized;
tokenizing happens on the tokenizer thread, never on the engine's; a prompt
plus an explicit ``max_tokens`` beyond the context is a 400 (as in vLLM). Every
error body is OpenAI's error JSON, 404, 405 and 413 included.

One request's failure fails it alone, with an error event (streamed) or a 500
(whole); see ``engine_loop``. A client that disconnects aborts its request
(aiohttp cancels the handler, whose ``finally`` posts an abort that frees the
request's KV blocks) and logs one line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

from aiohttp import web

from tinyserve.engine import LLM, LLMEngine
from tinyserve.metrics import Histogram
from tinyserve.serving.engine_loop import Delta, EngineError, EngineLoop
from tinyserve.serving.errors import (BadRequest, error_event, error_response, json_errors,
                                      param_of, read_body)
from tinyserve.serving.processes import setup_logging
from tinyserve.serving.request_parsing import (ParsedRequest, chat_renderer, check_context,
                                               decode_json, parse_request)
from tinyserve.serving.responses import (SSE_DONE, chunk_choice, completion_body,
                                         completion_chunk, sse, usage, usage_chunk, whole_choice)
from tinyserve.serving.stops_and_logprobs import LogprobFormatter
from tinyserve.tokenizer import ByteBPETokenizer

log = logging.getLogger("tinyserve.serving")

SERVER_STEP_STATS_WINDOW = 256
# Without an explicit max_prompt_chars: a text longer than max_model_len tokens of this
# many characters each is rejected untokenized. Exact for our byte-level tokenizer
# (no token is longer); for a checkpoint's tokenizer the bound is capped at 32
# characters a token (far above real text's 3-5) and allows for a normalizer that
# shortens text (NFC composes up to 4 characters into one).
MAX_CHARS_PER_TOKEN = 32
NORMALIZER_SLACK = 4
# After a 408/413 the rest of the body is read (and dropped) for at most this long, so the
# client can finish sending and read the error, then the connection is closed.
LINGERING_TIME = 2.0


@dataclass
class ServerConfig:
    """Limits and timeouts of one server (``tinyserve serve --max-request-bytes ...``)."""
    max_request_bytes: int = 16 * 2**20
    header_timeout: float = 60.0        # request line + headers, from connect (or last response)
    body_timeout: float = 60.0          # the whole body, once the headers are in
    max_prompt_chars: int | None = None  # None: from the context and the tokenizer

    def __post_init__(self):
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be an integer >= 1, "
                             f"got {self.max_request_bytes!r}")
        for name in ("header_timeout", "body_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.max_prompt_chars is not None and (not isinstance(self.max_prompt_chars, int)
                                                  or self.max_prompt_chars < 1):
            raise ValueError(f"max_prompt_chars must be an integer >= 1, "
                             f"got {self.max_prompt_chars!r}")

    def runner_kwargs(self) -> dict:
        """What aiohttp's ``run_app`` / ``AppRunner`` / ``TestServer`` need for these limits.
        aiohttp closes a connection whose request head has not arrived within its
        keep-alive timeout (counted from connect, or from the end of the last
        response), which makes that timeout the header read timeout."""
        return {"handler_cancellation": True, "keepalive_timeout": float(self.header_timeout),
                "access_log": None, "lingering_time": LINGERING_TIME}


def default_max_prompt_chars(engine: LLMEngine) -> int:
    """The longest prompt (in characters) worth tokenizing: see ``MAX_CHARS_PER_TOKEN``."""
    tok = engine.tokenizer
    per_token = getattr(tok, "max_token_chars", MAX_CHARS_PER_TOKEN)
    if isinstance(tok, ByteBPETokenizer):
        return engine.config.max_model_len * per_token
    return engine.config.max_model_len * min(per_token, MAX_CHARS_PER_TOKEN) * NORMALIZER_SLACK


def request_size_limit(config: ServerConfig, max_prompt_chars: int, max_model_len: int) -> int:
    """The largest body worth reading: ``max_request_bytes``, or less when even the longest
    acceptable prompt needs less (6 bytes a character at worst in JSON, 12 a token id,
    64 a chat message, plus 1 MiB for everything else), so that a 10 MB prompt for a
    small context is a 413 before it is decoded."""
    need = 6 * max_prompt_chars + 12 * max_model_len + 64 * max_model_len + 2**20
    return min(config.max_request_bytes, need)


@dataclass
class _State:
    """What the handlers share."""
    loop: EngineLoop
    model: str
    render: object                      # messages -> prompt (request_parsing.chat_renderer)
    config: ServerConfig
    max_prompt_chars: int
    max_request_bytes: int              # the effective limit (request_size_limit)
    tokenizer_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tinyserve-tokenize"))
    request_rejected_total: int = 0     # written by the event loop only

    @property
    def engine(self) -> LLMEngine:
        return self.loop.engine


STATE_KEY = web.AppKey("server_state", _State)
ENGINE_KEY = web.AppKey("engine_loop", EngineLoop)
MODEL_KEY = web.AppKey("model_name", str)


def engine_snapshot(engine: LLMEngine, check: bool = False) -> dict:
    bm = engine.block_manager
    snap = {"num_waiting": engine.num_waiting, "num_running": engine.num_running,
            "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
            "num_cached_free_blocks": bm.num_cached_free_blocks, "kv_cache_usage": bm.usage,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "prefix_cache_queries": bm.num_queried_tokens, "prefix_cache_hits": bm.num_hit_tokens,
            "num_preemptions_total": engine.scheduler.num_preemptions}
    if check:
        try:
            bm.check_integrity()
            snap["integrity"] = "ok"
        except AssertionError as exc:
            snap["integrity"] = str(exc)
    return snap


# ---- completions -------------------------------------------------------------------

async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


def _tokenize(state: _State, parsed: ParsedRequest) -> list[int]:
    """On the tokenizer thread: the prompt's token ids, checked against the context."""
    engine = state.engine
    field_ = "messages" if parsed.chat else "prompt"
    problem = None
    try:
        prompt = state.render(parsed.messages) if parsed.chat else parsed.prompt
        ids = engine.to_token_ids(prompt)
    except ValueError as exc:
        problem = BadRequest(str(exc), field_)
    except Exception as exc:             # a checkpoint's chat template may refuse messages
        if not parsed.chat:
            raise
        problem = BadRequest(f"the chat template failed: {type(exc).__name__}: {exc}", field_)
    if problem is not None:
        raise problem
    check_context(parsed, len(ids), engine.config.max_model_len)
    try:
        engine.check_fits(len(ids), parsed.params)
    except ValueError as exc:
        param = param_of(str(exc)) or field_
        raise BadRequest(str(exc), parsed.max_tokens_field if param == "max_tokens" else param
                         ) from None
    return ids


async def _completion(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    received = state.engine.clock()          # TTFT counts from here
    try:
        raw = await read_body(request, state.config.body_timeout, state.max_request_bytes)
        parsed = parse_request(decode_json(raw), chat, state.model, state.max_prompt_chars,
                               state.engine.config.max_model_len)
        del raw
        ids = await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, _tokenize,
                                                               state, parsed)
    except BadRequest as exc:
        state.request_rejected_total += 1
        return exc.response()
    return await _serve(request, state, parsed, ids, received)


class _Choice:
    """One choice's progress (``n`` of them per request)."""

    def __init__(self, index: int, formatter: LogprobFormatter | None):
        self.index, self.formatter = index, formatter
        self.finished, self.finish_reason, self.first = False, None, True
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.num_output_tokens = 0

    def take(self, delta: Delta) -> dict | None:
        """Record a delta; return its logprobs in OpenAI's format (None if not asked)."""
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.num_output_tokens = delta.num_output_tokens
        if delta.finished:
            self.finished, self.finish_reason = True, delta.finish_reason
        if self.formatter is None or delta.logprobs is None:
            return None
        part = self.formatter.format(delta.token_ids, delta.logprobs)
        self.logprobs.append(part)
        return part


async def _serve(request: web.Request, state: _State, parsed: ParsedRequest, ids: list[int],
                 received: float) -> web.StreamResponse:
    loop_ = state.loop
    queue: asyncio.Queue = asyncio.Queue()
    choices: dict[str, _Choice] = {}
    rid = None
    try:
        try:
            for i in range(parsed.n):
                request_id = await loop_.add(ids, parsed.choice_params(i), queue, parsed.stop,
                                             received)
                formatter = (LogprobFormatter(state.engine.tokenizer, parsed.chat)
                             if parsed.params.logprobs is not None else None)
                choices[request_id] = _Choice(i, formatter)
        except ValueError as exc:
            state.request_rejected_total += 1
            return error_response(str(exc), param_of(str(exc)))
        except EngineError as exc:
            return error_response(str(exc), None, 500, "internal_server_error")
        rid = ("chatcmpl-" if parsed.chat else "cmpl-") + next(iter(choices)).split("-", 1)[1]
        created = int(time.time())
        if parsed.stream:
            return await _stream(request, queue, choices, parsed, rid, created, state.model,
                                 len(ids))
        return await _whole(queue, choices, parsed, rid, created, state.model, len(ids))
    except asyncio.CancelledError:           # the client went away (handler cancelled)
        _log_disconnect(rid, choices)
        raise
    finally:
        for request_id, choice in choices.items():
            if not choice.finished:          # client went away (or we failed): free blocks
                loop_.abort(request_id)


def _log_disconnect(rid: str | None, choices: dict[str, _Choice]) -> None:
    if any(not c.finished for c in choices.values()):
        tokens = sum(c.num_output_tokens for c in choices.values())
        log.info("client disconnected: %s aborted after %d tokens", rid or "request", tokens)


async def _next(queue: asyncio.Queue, choices: dict[str, _Choice]) -> tuple[_Choice, Delta]:
    """The next delta of an unfinished choice; raises the ``EngineError`` of a failed one."""
    while True:
        item = await queue.get()
        choice = choices.get(item.request_id)
        if choice is None or choice.finished:
            continue
        if isinstance(item, EngineError):
            choice.finished = True              # aborted by the engine already
            raise item
        return choice, item


async def _whole(queue: asyncio.Queue, choices: dict[str, _Choice], parsed: ParsedRequest,
                 rid: str, created: int, model: str, num_prompt: int) -> web.Response:
    """Wait for every choice, answer in one JSON body (a 500 if the engine failed it)."""
    try:
        while not all(c.finished for c in choices.values()):
            choice, delta = await _next(queue, choices)
            choice.take(delta)
    except EngineError as exc:
        return error_response(str(exc), None, 500, "internal_server_error")
    body_choices = [whole_choice(c.index, parsed.chat, "".join(c.text), c.finish_reason,
                                 c.token_ids if parsed.return_token_ids else None,
                                 LogprobFormatter.join(c.logprobs, parsed.chat)
                                 if c.formatter is not None else None)
                    for c in choices.values()]
    total = sum(c.num_output_tokens for c in choices.values())
    return web.json_response(completion_body(rid, created, model, parsed.chat, body_choices,
                                             usage(num_prompt, total)))


async def _stream(request: web.Request, queue: asyncio.Queue, choices: dict[str, _Choice],
                  parsed: ParsedRequest, rid: str, created: int, model: str,
                  num_prompt: int) -> web.StreamResponse:
    """Stream every choice as server-sent events, one per choice per engine step, then
    ``[DONE]``; a failure ends the stream with an error event, then ``[DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    try:
        await response.prepare(request)
        try:
            while not all(c.finished for c in choices.values()):
                choice, delta = await _next(queue, choices)
                logprobs = choice.take(delta)
                part = chunk_choice(choice.index, parsed.chat, delta.text, delta.finish_reason,
                                    delta.token_ids if parsed.return_token_ids else None,
                                    choice.first, logprobs)
                choice.first = False
                await response.write(sse(completion_chunk(rid, created, model, parsed.chat,
                                                          [part])))
        except EngineError as exc:
            await response.write(error_event(str(exc)))
            await response.write_eof()
            return response
        if parsed.include_usage:
            total = sum(c.num_output_tokens for c in choices.values())
            await response.write(sse(usage_chunk(rid, created, model, parsed.chat,
                                                 usage(num_prompt, total))))
        await response.write(SSE_DONE)
        await response.write_eof()
    except ConnectionError:                   # the client went away mid-write
        _log_disconnect(rid, choices)
    return response


# ---- health, models, debug ---------------------------------------------------------

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
                request_abort_total=loop_.request_abort_total,
                request_failure_total=loop_.request_failure_total,
                request_rejected_total=request.app[STATE_KEY].request_rejected_total)
    return web.json_response(snap)


# ---- /metrics ----------------------------------------------------------------------

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
    ("request_failure_total", "counter",
     "Requests that failed in the engine (each alone, with an error event).",
     "request_failure_total"),
    ("request_rejected_total", "counter",
     "Completion requests refused before the engine (4xx: invalid, too long, unsupported).",
     "request_rejected_total"),
    ("num_preemptions_total", "counter",
     "Preemptions: a running request's KV blocks dropped, to be recomputed.",
     "num_preemptions_total"),
    ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", "prompt_tokens_total"),
    ("generation_tokens_total", "counter", "Output tokens generated.", "generation_tokens_total"),
]

# name, help, value key (a Histogram): the latencies observed once per request that
# finished by stop or length, on the engine's clock, from when the server received it;
# the step tokens once per engine step.
HISTOGRAMS = [
    ("time_to_first_token_seconds", "Time to first token: first token - arrival, seconds.",
     "ttft"),
    ("time_per_output_token_seconds",
     "Time per output token after the first, per request: (e2e - ttft) / (tokens - 1), seconds.",
     "tpot"),
    ("e2e_request_latency_seconds", "End-to-end request latency: finish - arrival, seconds.",
     "e2e"),
    ("iteration_tokens_total", "Tokens scheduled per engine step (prefill + decode).", "step_tokens"),
]


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def prometheus_text(values: dict, model: str, prefix: str = "tinyserve:") -> str:
    """Prometheus text format: ``METRICS`` from ``values``, and ``HISTOGRAMS`` (``values[key]``
    a ``Histogram``) as cumulative ``_bucket{le=...}`` series ending at ``+Inf``, ``_sum``
    and ``_count``."""
    label = f'model_name="{model}"'
    lines = []
    for name, kind, help_text, key in METRICS:
        lines += [f"# HELP {prefix}{name} {help_text}", f"# TYPE {prefix}{name} {kind}",
                  f"{prefix}{name}{{{label}}} {float(values[key])!r}"]
    for name, help_text, key in HISTOGRAMS:
        hist: Histogram = values[key]
        lines += [f"# HELP {prefix}{name} {help_text}", f"# TYPE {prefix}{name} histogram"]
        lines += [f'{prefix}{name}_bucket{{{label},le="{_le(b)}"}} {float(n)!r}'
                  for b, n in hist.cumulative()]
        lines += [f"{prefix}{name}_sum{{{label}}} {float(hist.sum)!r}",
                  f"{prefix}{name}_count{{{label}}} {float(hist.count)!r}"]
    return "\n".join(lines) + "\n"


async def metrics(request: web.Request) -> web.Response:
    loop_ = request.app[ENGINE_KEY]

    def snapshot(engine: LLMEngine) -> dict:       # on the engine thread: consistent
        values = engine_snapshot(engine)
        values.update(request_success_total=loop_.request_success_total,
                      request_abort_total=loop_.request_abort_total,
                      request_failure_total=loop_.request_failure_total,
                      prompt_tokens_total=loop_.prompt_tokens_total,
                      generation_tokens_total=loop_.generation_tokens_total,
                      ttft=loop_.ttft.copy(), tpot=loop_.tpot.copy(), e2e=loop_.e2e.copy(),
                      step_tokens=loop_.step_tokens.copy())
        return values

    values = await loop_.call(snapshot)
    values["request_rejected_total"] = request.app[STATE_KEY].request_rejected_total
    return web.Response(text=prometheus_text(values, request.app[MODEL_KEY]),
                        content_type="text/plain", charset="utf-8")


# ---- the app -----------------------------------------------------------------------

ROUTES = [web.post("/v1/completions", completions),
          web.post("/v1/chat/completions", chat_completions),
          web.get("/health", health),
          web.get("/v1/models", models),
          web.get("/metrics", metrics),
          web.get("/debug/engine", debug_engine)]


async def start_engine(app: web.Application) -> None:
    app[ENGINE_KEY].start()


async def stop_engine(app: web.Application) -> None:
    await asyncio.get_running_loop().run_in_executor(None, app[ENGINE_KEY].stop)
    app[STATE_KEY].tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def build_app(engine: LLMEngine, model_name: str,
              config: ServerConfig | None = None) -> web.Application:
    """The aiohttp app; the engine thread starts and stops with it. Serve it with
    ``config.runner_kwargs()`` (``serve`` does) for the header timeout."""
    config = config or ServerConfig()
    max_chars = config.max_prompt_chars or default_max_prompt_chars(engine)
    max_bytes = request_size_limit(config, max_chars, engine.config.max_model_len)
    app = web.Application(client_max_size=max_bytes, middlewares=[json_errors(max_bytes, log)])
    loop_ = EngineLoop(engine)
    app[STATE_KEY] = _State(loop_, model_name, chat_renderer(engine.tokenizer), config,
                            max_chars, max_bytes)
    app[ENGINE_KEY] = loop_
    app[MODEL_KEY] = model_name
    app.on_startup.append(start_engine)
    app.on_shutdown.append(stop_engine)
    app.add_routes(ROUTES)
    return app


def serve(model: str = "tiny-zh", host: str = "127.0.0.1", port: int = 8000,
          served_model_name: str | None = None, threads: int | None = None,
          config: ServerConfig | None = None, **llm_kwargs) -> None:
    """Load the model, then serve until SIGINT/SIGTERM (which also stop the engine thread)."""
    if threads:
        import torch
        torch.set_num_threads(threads)
    setup_logging()
    config = config or ServerConfig()
    # A long-lived server keeps counters for /metrics, not a history of every step.
    llm = LLM(model=model, step_stats_window=SERVER_STEP_STATS_WINDOW, **llm_kwargs)
    app = build_app(llm.engine, served_model_name or model, config)
    print(f"tinyserve: serving {model!r} on http://{host}:{port} "
          f"({llm.engine.block_manager.num_blocks} KV blocks)", flush=True)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts.
    web.run_app(app, host=host, port=port, print=None, shutdown_timeout=5.0,
                **config.runner_kwargs())
