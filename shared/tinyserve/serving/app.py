"""An OpenAI-compatible streaming HTTP server in front of one ``LLMEngine``.

    tinyserve serve --model tiny-zh --host 127.0.0.1 --port 8000
    python -m tinyserve serve --model tiny --port 8001 --max-num-seqs 16

Two threads, two jobs: the aiohttp event loop runs the handlers here, and one
engine thread (``tinyserve.serving.engine_loop.EngineLoop``) owns the engine.
The request and response format is ``tinyserve.serving.protocol``.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions``
(``stream`` true/false; streamed as server-sent events ``data: {json}\\n\\n``
ending with ``data: [DONE]\\n\\n``), ``GET /health``, ``GET /v1/models``,
``GET /metrics`` (Prometheus text) and ``GET /debug/engine`` (block accounting,
checked on the engine thread).

A client that disconnects aborts its request: aiohttp cancels the handler,
whose ``finally`` posts an abort that the engine thread applies before its
next step, which frees the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from tinyserve.engine import LLM, LLMEngine
from tinyserve.serving.engine_loop import EngineError, EngineLoop, RequestHandle
from tinyserve.serving.protocol import (SSE_DONE, BadRequest, ParsedRequest, chat_renderer,
                                        completion_body, completion_chunk, decode_json, error_body,
                                        error_response, param_of, parse_request, sse, usage,
                                        usage_chunk)

ENGINE_KEY = web.AppKey("engine_loop", EngineLoop)
MODEL_KEY = web.AppKey("model_name", str)
CHAT_KEY = web.AppKey("chat_renderer", object)      # messages -> prompt (protocol.chat_renderer)
SERVER_STEP_STATS_WINDOW = 256


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


# ---- completions -------------------------------------------------------------------

async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


async def _completion(request: web.Request, chat: bool) -> web.StreamResponse:
    loop_ = request.app[ENGINE_KEY]
    model = request.app[MODEL_KEY]
    try:
        parsed = parse_request(decode_json(await request.read()), chat, model, request.app[CHAT_KEY])
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
        return await _whole(handle, parsed, rid, created, model)
    except EngineError as exc:
        return error_response(str(exc), status=500, kind="internal_server_error")
    finally:
        if not handle.finished:             # client went away (or we failed): free its blocks
            loop_.abort(handle.request_id)


async def _whole(handle: RequestHandle, parsed: ParsedRequest, rid: str, created: int,
                 model: str) -> web.Response:
    """Wait for the whole completion, answer it in one JSON body."""
    text, ids = [], []
    while not handle.finished:
        delta = await handle.next_delta()
        text.append(delta.text)
        ids.extend(delta.token_ids)
    body = completion_body(rid, created, model, parsed.chat, "".join(text), delta.finish_reason,
                           ids if parsed.return_token_ids else None,
                           usage(delta.num_prompt_tokens, delta.num_output_tokens))
    return web.json_response(body)


async def _stream(request: web.Request, handle: RequestHandle, parsed: ParsedRequest, rid: str,
                  created: int, model: str) -> web.StreamResponse:
    """Stream the completion as server-sent events, one per engine step, then ``[DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    first = True
    try:
        while not handle.finished:
            delta = await handle.next_delta()
            ids = delta.token_ids if parsed.return_token_ids else None
            await response.write(sse(completion_chunk(rid, created, model, parsed.chat,
                                                      delta.text, delta.finish_reason, ids,
                                                      first)))
            first = False
    except EngineError as exc:
        await response.write(sse(error_body(str(exc), status=500, kind="internal_server_error")))
    else:
        if parsed.include_usage:
            usage_ = usage(delta.num_prompt_tokens, delta.num_output_tokens)
            await response.write(sse(usage_chunk(rid, created, model, parsed.chat, usage_)))
    await response.write(SSE_DONE)
    await response.write_eof()
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
                request_abort_total=loop_.request_abort_total)
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


def build_app(engine: LLMEngine, model_name: str) -> web.Application:
    """The aiohttp app; the engine thread starts and stops with it."""
    app = web.Application(client_max_size=16 * 2**20)
    app[ENGINE_KEY] = EngineLoop(engine)
    app[MODEL_KEY] = model_name
    app[CHAT_KEY] = chat_renderer(engine.tokenizer)
    app.on_startup.append(start_engine)
    app.on_shutdown.append(stop_engine)
    app.add_routes(ROUTES)
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
