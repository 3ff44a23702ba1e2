"""A streaming HTTP router over replicas, choosing each with a policy of
``tinyserve.sim.routing`` (round_robin, least_outstanding, cache_aware).

    tinyserve route --replicas http://127.0.0.1:8001,http://127.0.0.1:8002 --policy cache_aware --port 8000

The key of a request is its token ids when the prompt is a list of ids, the
prompt string otherwise (for chat, the rendered messages).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Sequence

import aiohttp
from aiohttp import web

from tinyserve.serving.processes import free_port, launch_servers, parse_prometheus
from tinyserve.serving.protocol import (BadRequest, decode_json, error_response, parse_messages,
                                        render_chat)
from tinyserve.sim.routing import RoutingPolicy, make_routing_policy


def request_key(body: dict, chat: bool) -> Sequence:
    """What the router matches on: token ids, or the (rendered) prompt text."""
    if chat:
        return render_chat(parse_messages(body.get("messages")))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return tuple(prompt)
    raise BadRequest("prompt must be a non-empty string or list of token ids", "prompt")


# ---- the HTTP router ------------------------------------------------------------------

POLICY_KEY = web.AppKey("policy", RoutingPolicy)
ROUTED_KEY = web.AppKey("routed", list)


@dataclass
class _RouterState:
    """What the router's handlers share: replica URLs, the policy, per-replica
    counters, and the client session (opened on startup, closed on cleanup)."""
    replicas: list[str]
    chooser: RoutingPolicy
    outstanding: list[int]
    routed: list[int]
    session: aiohttp.ClientSession | None = None


_STATE_KEY = web.AppKey("router_state", _RouterState)


def build_router_app(replicas: list[str], policy: str | RoutingPolicy = "round_robin",
                     **policy_kwargs):
    """An aiohttp app proxying completions to ``replicas`` chosen by ``policy``."""
    replicas = [u.rstrip("/") for u in replicas]
    if not replicas:
        raise ValueError("replicas must name at least one URL")
    chooser = (policy if isinstance(policy, RoutingPolicy)
               else make_routing_policy(policy, len(replicas), **policy_kwargs))
    state = _RouterState(replicas, chooser, outstanding=[0] * len(replicas),
                         routed=[0] * len(replicas))
    app = web.Application(client_max_size=16 * 2**20)
    app.on_startup.append(_open_session)
    app.on_cleanup.append(_close_session)
    app.router.add_post("/v1/completions", _proxy)
    app.router.add_post("/v1/chat/completions", _proxy)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app[_STATE_KEY] = state
    app[POLICY_KEY] = chooser
    app[ROUTED_KEY] = state.routed
    return app


async def _open_session(app: web.Application) -> None:
    """One client session for all upstream calls."""
    # No connection limit: the replicas' own queues decide how many run.
    app[_STATE_KEY].session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))


async def _close_session(app: web.Application) -> None:
    await app[_STATE_KEY].session.close()


def _routing_key(raw: bytes, chat: bool) -> Sequence:
    """The key of a raw request body; ``BadRequest`` if it is not a JSON object with a prompt."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return request_key(body, chat)


async def _proxy(request: web.Request) -> web.StreamResponse:
    """Choose a replica for the request's key and stream that replica's answer back."""
    state = request.app[_STATE_KEY]
    chat = request.path.endswith("/chat/completions")
    raw = await request.read()
    try:
        key = _routing_key(raw, chat)
    except BadRequest as exc:
        return exc.response()
    replica = state.chooser.choose(key, list(state.outstanding))
    state.outstanding[replica] += 1
    state.routed[replica] += 1
    try:
        return await _stream_from_replica(state, replica, request, raw)
    finally:
        state.outstanding[replica] -= 1
        state.chooser.on_finish(replica, key)


async def _stream_from_replica(state: _RouterState, replica: int, request: web.Request,
                               raw: bytes) -> web.StreamResponse:
    """Post ``raw`` to ``replica`` and pass its response through; 502 if it cannot be reached."""
    response = None
    try:
        async with state.session.post(state.replicas[replica] + request.path, data=raw,
                                      headers={"Content-Type": "application/json"}) as up:
            response = web.StreamResponse(status=up.status, headers={
                "Content-Type": up.headers.get("Content-Type", "application/json"),
                "X-Tinyserve-Replica": str(replica)})
            await response.prepare(request)
            # Bytes go through as they arrive: streaming stays streaming.
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except aiohttp.ClientError as exc:
        if response is not None:        # headers already sent: just end the stream
            return response
        return error_response(f"replica {state.replicas[replica]} failed: {exc}", None, 502,
                              "bad_gateway")


async def _health(request: web.Request) -> web.Response:
    state = request.app[_STATE_KEY]
    return web.json_response({"status": "ok", "policy": state.chooser.name,
                              "replicas": state.replicas})


async def _models(request: web.Request) -> web.Response:
    """The first replica's model list (all replicas serve the same model)."""
    state = request.app[_STATE_KEY]
    async with state.session.get(state.replicas[0] + "/v1/models") as up:
        return web.Response(body=await up.read(), status=up.status,
                            content_type="application/json")


async def _metrics(request: web.Request) -> web.Response:
    """Prometheus text: requests routed to, and in flight on, each replica."""
    state = request.app[_STATE_KEY]
    replicas, routed, outstanding = state.replicas, state.routed, state.outstanding
    lines = ["# HELP tinyserve_router:requests_routed_total Requests sent to each replica.",
             "# TYPE tinyserve_router:requests_routed_total counter"]
    lines += [f'tinyserve_router:requests_routed_total{{replica="{u}"}} {routed[i]}'
              for i, u in enumerate(replicas)]
    lines += ["# HELP tinyserve_router:requests_outstanding Requests in flight per replica.",
              "# TYPE tinyserve_router:requests_outstanding gauge"]
    lines += [f'tinyserve_router:requests_outstanding{{replica="{u}"}} {outstanding[i]}'
              for i, u in enumerate(replicas)]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def route(replicas: list[str], policy: str = "round_robin", host: str = "127.0.0.1",
          port: int = 8000, **policy_kwargs) -> None:
    app = build_router_app(replicas, policy, **policy_kwargs)
    print(f"tinyserve router ({policy}) on http://{host}:{port} over {len(replicas)} replicas",
          flush=True)
    web.run_app(app, host=host, port=port, handler_cancellation=True, print=None,
                access_log=None, shutdown_timeout=5.0)


# ---- the benchmark: routing policies compared on real replicas ------------------------

async def _replica_counters(session, urls: list[str]) -> tuple[float, float]:
    queries = hits = 0.0
    for u in urls:
        async with session.get(u + "/metrics") as r:
            values = parse_prometheus(await r.text())
        queries += values["tinyserve:prefix_cache_queries_total"]
        hits += values["tinyserve:prefix_cache_hits_total"]
    return queries, hits


async def compare_policies_async(replicas: list[str], specs_for: Any,
                                 policies: Sequence[str] = ("round_robin", "least_outstanding",
                                                            "cache_aware"),
                                 model: str | None = None, progress: bool = False,
                                 **policy_kwargs) -> list[dict]:
    """Run the benchmark client through an in-process router under each policy.

    ``specs_for(policy_index)`` returns ``(specs, prompts)`` for that run (give
    each run fresh prefixes so that one run's cache does not help the next).
    The prefix-cache hit rate is measured on the replicas (their /metrics
    counters before and after the run), so it counts what really was reused.
    """
    from tinyserve.serving.client import run_benchmark

    rows = []
    async with aiohttp.ClientSession() as session:
        for k, name in enumerate(policies):
            specs, prompts = specs_for(k)
            app = build_router_app(replicas, name, **(policy_kwargs if name == "cache_aware" else {}))
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            port = free_port()
            site = web.TCPSite(runner, "127.0.0.1", port)
            await site.start()
            try:
                q0, h0 = await _replica_counters(session, replicas)
                result = await run_benchmark(f"http://127.0.0.1:{port}", specs, prompts=prompts,
                                             model=model, progress=progress)
                q1, h1 = await _replica_counters(session, replicas)
            finally:
                await runner.cleanup()
            rows.append({"policy": name, "prefix_cache_hit_rate": (h1 - h0) / (q1 - q0)
                         if q1 > q0 else 0.0,
                         "mean_ttft": result["mean_ttft"], "median_ttft": result["median_ttft"],
                         "mean_e2e": result["mean_e2e"], "completed": result["completed"],
                         "errors": result["errors"], "routed": list(app[ROUTED_KEY])})
    return rows


def format_policy_table(rows: list[dict]) -> str:
    lines = [f"{'policy':<18} {'hit rate':>9} {'mean TTFT ms':>13} {'median TTFT ms':>15} "
             f"{'errors':>7}  routed per replica"]
    for r in rows:
        lines.append(f"{r['policy']:<18} {r['prefix_cache_hit_rate']:>9.3f} "
                     f"{1e3 * r['mean_ttft']:>13.1f} {1e3 * r['median_ttft']:>15.1f} "
                     f"{r['errors']:>7}  {r['routed']}")
    return "\n".join(lines)


def compare_policies(replicas: list[str], specs_for: Any, print_table: bool = True,
                     **kwargs) -> list[dict]:
    rows = asyncio.run(compare_policies_async(replicas, specs_for, **kwargs))
    if print_table:
        print(format_policy_table(rows))
    return rows


def shared_prefix_runs(workload: str = "shared-prefix", num_requests: int = 48,
                       rate: float = 20.0, seed: int = 0, **workload_kwargs):
    """``specs_for`` for ``compare_policies``: the same workload shape, fresh prompts per run."""
    from tinyserve.serving.client import build_prompts
    from tinyserve.workload import make_workload

    def specs_for(k: int):
        specs = make_workload(workload, num_requests=num_requests, rate=rate, seed=seed + k,
                              **workload_kwargs)
        return specs, build_prompts(specs, seed=seed + k)
    return specs_for


def bench_routing(num_replicas: int = 3, model: str = "tiny", replica_args: Sequence[str] = (),
                  replicas: list[str] | None = None, **kwargs) -> list[dict]:
    """Start ``num_replicas`` servers (unless ``replicas`` are given), compare the policies."""
    bench_keys = ("workload", "num_requests", "rate", "seed", "max_len", "burstiness",
                  "length_scale", "num_prefix_groups", "prefix_len")
    wk = {k: kwargs.pop(k) for k in bench_keys if k in kwargs and kwargs[k] is not None}
    specs_for = shared_prefix_runs(**wk)
    if replicas:
        return compare_policies(replicas, specs_for, **kwargs)
    procs = launch_servers(num_replicas, model, list(replica_args))
    try:
        return compare_policies([p.url for p in procs], specs_for, **kwargs)
    finally:
        for p in procs:
            p.stop()

