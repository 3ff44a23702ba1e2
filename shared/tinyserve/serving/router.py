"""A streaming HTTP router over replicas, choosing each with a policy of
``tinyserve.routing`` (round_robin, least_outstanding, cache_aware).

    tinyserve route --replicas http://127.0.0.1:8001,http://127.0.0.1:8002 --policy cache_aware --port 8000

The key of a request is its token ids when the prompt is a list of ids, the
prompt string otherwise (for chat, the rendered messages).

It survives replicas that fail (``RouterConfig``): active ``/health`` probes eject
a replica and re-admit it once it answers again; a request whose replica cannot
be reached before it answers goes to another one; a replica that falls silent
for ``read_timeout`` is given up on; a stream that a replica cuts mid-way ends
with an OpenAI error event and ``[DONE]`` (the ``openai`` SDK raises), never as a
truncated answer that looks complete. ``/health`` reports every replica (503
once none is healthy), completions get a 503 when no replica can be reached, and
``/v1/models`` answers while any replica does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import aiohttp
from aiohttp import web

from tinyserve.serving.errors import BadRequest, error_event, error_response, json_errors, read_body
from tinyserve.serving.processes import free_port, launch_servers, setup_logging
from tinyserve.serving.request_parsing import decode_json, parse_messages, render_chat
from tinyserve.serving.responses import SSE_DONE
from tinyserve.serving.scrape import parse_metrics
from tinyserve.routing import RoutingPolicy, make_routing_policy


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
log = logging.getLogger("tinyserve.router")


@dataclass
class RouterConfig:
    """Health checks, failover and timeouts (``tinyserve route --health-interval ...``).

    Every ``health_interval`` seconds each replica's ``/health`` is probed;
    ``unhealthy_after`` failed probes in a row eject it (a refused connection or a
    stream cut by the replica ejects it at once), ``healthy_after`` good ones
    re-admit it. A request whose replica cannot be connected to, or drops the
    connection before answering, is retried on another replica (each replica at
    most once). ``read_timeout``: the longest the router waits for a replica's next
    bytes (headers included) before giving up on it (504, or an error event).
    """
    health_interval: float = 2.0
    health_timeout: float = 2.0
    unhealthy_after: int = 2
    healthy_after: int = 2
    connect_timeout: float = 5.0
    read_timeout: float = 120.0
    header_timeout: float = 60.0        # the router's own clients, as ServerConfig
    body_timeout: float = 60.0
    max_request_bytes: int = 16 * 2**20

    def __post_init__(self):
        for name in ("health_interval", "health_timeout", "connect_timeout", "read_timeout",
                     "header_timeout", "body_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        for name in ("unhealthy_after", "healthy_after", "max_request_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def runner_kwargs(self) -> dict:
        """For ``run_app`` / ``AppRunner`` / ``TestServer`` (see ``app.ServerConfig``)."""
        return {"handler_cancellation": True, "keepalive_timeout": float(self.header_timeout),
                "access_log": None, "lingering_time": 2.0}


@dataclass
class _RouterState:
    """What the router's handlers share: replica URLs, the policy, per-replica
    counters and health, and the client session (opened on startup, closed on cleanup)."""
    replicas: list[str]
    chooser: RoutingPolicy
    config: RouterConfig
    outstanding: list[int]
    routed: list[int]
    healthy: list[bool] = field(default_factory=list)
    ejections: list[int] = field(default_factory=list)
    retries: int = 0
    session: aiohttp.ClientSession | None = None
    prober: asyncio.Task | None = None
    _fails: list[int] = field(default_factory=list)     # failed probes in a row
    _oks: list[int] = field(default_factory=list)       # good probes in a row

    def __post_init__(self):
        n = len(self.replicas)
        self.healthy, self.ejections = [True] * n, [0] * n
        self._fails, self._oks = [0] * n, [0] * n

    def eject(self, replica: int, reason: str) -> None:
        self._oks[replica] = 0
        if self.healthy[replica]:
            self.healthy[replica] = False
            self.ejections[replica] += 1
            log.warning("replica %s ejected: %s", self.replicas[replica], reason)

    def probed(self, replica: int, ok: bool, reason: str = "") -> None:
        if ok:
            self._fails[replica] = 0
            self._oks[replica] += 1
            if not self.healthy[replica] and self._oks[replica] >= self.config.healthy_after:
                self.healthy[replica] = True
                log.info("replica %s re-admitted", self.replicas[replica])
        else:
            self._fails[replica] += 1
            self._oks[replica] = 0
            if self._fails[replica] >= self.config.unhealthy_after:
                self.eject(replica, f"health check failed {self._fails[replica]} times ({reason})")

    def choose(self, key: Sequence, tried: set[int]) -> int | None:
        """The policy's choice if it is healthy and untried; else the least loaded healthy
        untried replica; else (every healthy one tried) an untried ejected one; else None."""
        n = len(self.replicas)
        live = [i for i in range(n) if self.healthy[i] and i not in tried]
        if not live:
            live = [i for i in range(n) if i not in tried]
            if not live:
                return None
        replica = self.chooser.choose(key, list(self.outstanding))
        if replica in live:
            return replica
        return min(live, key=lambda i: (self.outstanding[i], (i - replica) % n))


_STATE_KEY = web.AppKey("router_state", _RouterState)


def build_router_app(replicas: list[str], policy: str | RoutingPolicy = "round_robin",
                     config: RouterConfig | None = None, **policy_kwargs):
    """An aiohttp app proxying completions to ``replicas`` chosen by ``policy``, with
    health checks and failover (``config``). Serve it with ``config.runner_kwargs()``."""
    replicas = [u.rstrip("/") for u in replicas]
    if not replicas:
        raise ValueError("replicas must name at least one URL")
    config = config or RouterConfig()
    chooser = (policy if isinstance(policy, RoutingPolicy)
               else make_routing_policy(policy, len(replicas), **policy_kwargs))
    state = _RouterState(replicas, chooser, config, outstanding=[0] * len(replicas),
                         routed=[0] * len(replicas))
    app = web.Application(client_max_size=config.max_request_bytes,
                          middlewares=[json_errors(config.max_request_bytes, log)])
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
    """One client session for all upstream calls, and the health prober."""
    state = app[_STATE_KEY]
    # No connection limit: the replicas' own queues decide how many run.
    state.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          timeout=aiohttp.ClientTimeout(total=None))
    state.prober = asyncio.create_task(_probe_forever(state))


async def _close_session(app: web.Application) -> None:
    state = app[_STATE_KEY]
    if state.prober is not None:
        state.prober.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await state.prober
    await state.session.close()


async def _probe(state: _RouterState, replica: int) -> None:
    timeout = aiohttp.ClientTimeout(total=state.config.health_timeout)
    try:
        async with state.session.get(state.replicas[replica] + "/health", timeout=timeout) as r:
            await r.read()
            state.probed(replica, r.status == 200, f"HTTP {r.status}")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        state.probed(replica, False, f"{type(exc).__name__}: {exc}"[:200])


async def _probe_forever(state: _RouterState) -> None:
    while True:
        await asyncio.gather(*(_probe(state, i) for i in range(len(state.replicas))))
        await asyncio.sleep(state.config.health_interval)


def _routing_key(raw: bytes, chat: bool) -> Sequence:
    """The key of a raw request body; ``BadRequest`` if it is not a JSON object with a prompt."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return request_key(body, chat)


_RETRY = object()       # _forward's answer when the replica could not be reached


async def _proxy(request: web.Request) -> web.StreamResponse:
    """Choose a replica for the request's key and stream that replica's answer back;
    a replica that cannot be reached before it answers is replaced by another."""
    state = request.app[_STATE_KEY]
    chat = request.path.endswith("/chat/completions")
    try:
        raw = await read_body(request, state.config.body_timeout, state.config.max_request_bytes)
        key = _routing_key(raw, chat)
    except BadRequest as exc:
        return exc.response()
    tried: set[int] = set()
    failures = []
    while True:
        replica = state.choose(key, tried)
        if replica is None:
            # Every replica was tried and none could be reached: nothing is up, as
            # /health (503) says by now, so 503 and not a gateway error.
            return error_response("no replica could be reached: " + "; ".join(failures), None,
                                  503, "service_unavailable")
        if tried:
            state.retries += 1
        tried.add(replica)
        state.outstanding[replica] += 1
        state.routed[replica] += 1
        try:
            outcome = await _forward(state, replica, request, raw, failures)
        except asyncio.CancelledError:      # our client went away: the upstream closes too
            log.info("client disconnected from a request to %s", state.replicas[replica])
            raise
        finally:
            state.outstanding[replica] -= 1
            state.chooser.on_finish(replica, key)
        if outcome is not _RETRY:
            return outcome


async def _forward(state: _RouterState, replica: int, request: web.Request, raw: bytes,
                   failures: list[str]):
    """Post ``raw`` to ``replica`` and pass its response through. ``_RETRY`` if it could
    not be connected to or dropped the connection before answering (it is ejected)."""
    url, cfg = state.replicas[replica], state.config
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout,
                                    sock_read=cfg.read_timeout)
    try:
        up = await state.session.post(url + request.path, data=raw, timeout=timeout,
                                      headers={"Content-Type": "application/json"})
    except aiohttp.ConnectionTimeoutError as exc:
        return _unreachable(state, replica, failures, f"connect timed out ({exc})")
    except asyncio.TimeoutError:
        return error_response(f"replica {url} did not answer within {cfg.read_timeout:g} s",
                              None, 504, "gateway_timeout")
    except aiohttp.ClientConnectionError as exc:
        return _unreachable(state, replica, failures, f"{type(exc).__name__}: {exc}")
    except aiohttp.ClientError as exc:
        return error_response(f"replica {url} failed: {exc}", None, 502, "bad_gateway")
    try:
        if up.status == 200 and up.headers.get("Content-Type", "").startswith("text/event-stream"):
            return await _relay_stream(state, replica, request, up)
        try:
            body = await up.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if isinstance(exc, aiohttp.ClientConnectionError) and not isinstance(
                    exc, asyncio.TimeoutError):
                state.eject(replica, f"connection lost mid-response: {exc}")
            return error_response(f"replica {url} failed mid-response: "
                                  f"{type(exc).__name__}: {exc}", None, 502, "bad_gateway")
        return web.Response(body=body, status=up.status, headers={
            "Content-Type": up.headers.get("Content-Type", "application/json"),
            "X-Tinyserve-Replica": str(replica)})
    finally:
        up.release()


def _unreachable(state: _RouterState, replica: int, failures: list[str], reason: str):
    state.eject(replica, reason)
    failures.append(f"{state.replicas[replica]}: {reason}")
    return _RETRY


async def _relay_stream(state: _RouterState, replica: int, request: web.Request,
                        up: aiohttp.ClientResponse) -> web.StreamResponse:
    """Pass whole server-sent events through as they arrive. If the replica goes away
    (or falls silent for ``read_timeout``) before ``[DONE]``, the partial event is
    dropped and the stream ends with an OpenAI error event and ``[DONE]``, never
    with what looks like a complete answer."""
    url = state.replicas[replica]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Tinyserve-Replica": str(replica)})
    buffer, done, problem = b"", False, None
    try:
        await response.prepare(request)
        chunks = up.content.iter_any().__aiter__()
        while not done:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                problem = "the replica closed the stream before [DONE]"
                break
            except asyncio.TimeoutError:
                problem = f"the replica sent nothing for {state.config.read_timeout:g} s"
                break
            except aiohttp.ClientError as exc:
                problem = f"{type(exc).__name__}: {exc}"
                break
            buffer += chunk
            cut = buffer.rfind(b"\n\n")
            if cut < 0:
                continue
            events, buffer = buffer[:cut + 2], buffer[cut + 2:]
            done = events.endswith(SSE_DONE)
            await response.write(events)
        if problem is not None:
            if "timed out" not in problem and "sent nothing" not in problem:
                state.eject(replica, f"stream cut: {problem}")
            log.warning("stream from %s cut: %s", url, problem)
            await response.write(error_event(f"replica {url} failed mid-stream: {problem}",
                                             502, "bad_gateway"))
        await response.write_eof()
    except ConnectionError:                   # our client went away: upstream closes too
        log.info("client disconnected from a request to %s", url)
    return response


async def _health(request: web.Request) -> web.Response:
    """``ok`` with every replica healthy, ``degraded`` (still 200) with some, 503 with none."""
    state = request.app[_STATE_KEY]
    up = sum(state.healthy)
    status = "ok" if up == len(state.replicas) else "degraded" if up else "unavailable"
    return web.json_response(
        {"status": status, "policy": state.chooser.name, "num_healthy": up,
         "replicas": [{"url": u, "healthy": state.healthy[i], "outstanding": state.outstanding[i],
                       "routed": state.routed[i], "ejections": state.ejections[i]}
                      for i, u in enumerate(state.replicas)]},
        status=200 if up else 503)


async def _models(request: web.Request) -> web.Response:
    """The model list of the first replica that answers, healthy ones first (all
    replicas serve the same model)."""
    state = request.app[_STATE_KEY]
    order = sorted(range(len(state.replicas)), key=lambda i: not state.healthy[i])
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=state.config.connect_timeout,
                                    sock_read=state.config.read_timeout)
    errors = []
    for i in order:
        try:
            async with state.session.get(state.replicas[i] + "/v1/models", timeout=timeout) as up:
                body = await up.read()
                if up.status == 200:
                    return web.Response(body=body, status=200, content_type="application/json")
                errors.append(f"{state.replicas[i]}: HTTP {up.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            errors.append(f"{state.replicas[i]}: {type(exc).__name__}")
    return error_response("no replica answered /v1/models: " + "; ".join(errors), None, 503,
                          "service_unavailable")


async def _metrics(request: web.Request) -> web.Response:
    """Prometheus text: requests routed to, in flight on, and health of each replica."""
    state = request.app[_STATE_KEY]
    series = [("requests_routed_total", "counter", "Requests sent to each replica.", state.routed),
              ("requests_outstanding", "gauge", "Requests in flight per replica.",
               state.outstanding),
              ("replica_healthy", "gauge", "1 while a replica is in rotation, 0 once ejected.",
               [int(h) for h in state.healthy]),
              ("replica_ejections_total", "counter", "Times each replica was ejected.",
               state.ejections)]
    lines = []
    for name, kind, help_text, values in series:
        lines += [f"# HELP tinyserve_router:{name} {help_text}",
                  f"# TYPE tinyserve_router:{name} {kind}"]
        lines += [f'tinyserve_router:{name}{{replica="{u}"}} {values[i]}'
                  for i, u in enumerate(state.replicas)]
    lines += ["# HELP tinyserve_router:request_retries_total Requests sent on to another "
              "replica after one could not be reached.",
              "# TYPE tinyserve_router:request_retries_total counter",
              f"tinyserve_router:request_retries_total {state.retries}"]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def route(replicas: list[str], policy: str = "round_robin", host: str = "127.0.0.1",
          port: int = 8000, config: RouterConfig | None = None, **policy_kwargs) -> None:
    setup_logging()
    config = config or RouterConfig()
    app = build_router_app(replicas, policy, config, **policy_kwargs)
    print(f"tinyserve router ({policy}) on http://{host}:{port} over {len(replicas)} replicas",
          flush=True)
    web.run_app(app, host=host, port=port, print=None, shutdown_timeout=5.0,
                **config.runner_kwargs())


# ---- the benchmark: routing policies compared on real replicas ------------------------

async def _replica_counters(session, urls: list[str]) -> tuple[float, float]:
    queries = hits = 0.0
    for u in urls:
        async with session.get(u + "/metrics") as r:
            scrape = parse_metrics(await r.text(), u + "/metrics")
        queries += scrape.total("tinyserve:prefix_cache_queries_total")
        hits += scrape.total("tinyserve:prefix_cache_hits_total")
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

