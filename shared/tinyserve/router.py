"""Routing requests over replicas: the policies, and a streaming HTTP router.

    tinyserve route --replicas http://127.0.0.1:8001,http://127.0.0.1:8002 --policy cache_aware --port 8000

The policies are small pure classes (no HTTP, no clock) so that the simulator
can run the same decisions over 8-64 simulated replicas:

* ``round_robin``: replica 0, 1, 2, ..., 0, ... whatever the load.
* ``least_outstanding``: the replica with the fewest requests in flight
  (ties go round-robin, so an idle fleet still spreads).
* ``cache_aware``: each replica gets a prefix tree of the keys routed to it,
  an estimate of what its prefix cache holds. A request goes to the replica
  whose tree shares the longest prefix with its key, so requests with the same
  system prompt meet the same cached blocks. Two guards (defaults below):
  if the fleet is imbalanced (max - min outstanding > ``balance_abs_threshold``
  and max > ``balance_rel_threshold`` * min) or the best match covers less than
  ``min_match_ratio`` of the key, the request goes to the least loaded replica
  instead. Either way the key is recorded in the chosen replica's tree. Each
  tree holds at most ``max_tree_size`` elements and forgets its least recently
  used leaves first, as the replica's cache would.
  The idea (prefix trees in the router, a load-balance escape hatch) is the one
  of SGLang's cache-aware router; this is an independent implementation.

The key of a request is its token ids when the prompt is a list of ids, the
prompt string otherwise (for chat, the rendered messages).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any, Sequence

import aiohttp
from aiohttp import web

# ---- the policies -------------------------------------------------------------------


class RoutingPolicy:
    name = "base"

    def __init__(self, num_replicas: int):
        if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
        self.num_replicas = num_replicas

    def choose(self, key: Sequence, outstanding: list[int]) -> int:
        raise NotImplementedError

    def on_finish(self, replica: int, key: Sequence) -> None:
        """Called when a routed request completes (default: nothing to update)."""

    def _check(self, outstanding: list[int]) -> None:
        if len(outstanding) != self.num_replicas:
            raise ValueError(f"outstanding has {len(outstanding)} entries for "
                             f"{self.num_replicas} replicas")


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, num_replicas: int):
        super().__init__(num_replicas)
        self._next = 0

    def choose(self, key, outstanding):
        self._check(outstanding)
        replica = self._next
        self._next = (self._next + 1) % self.num_replicas
        return replica


def _least_loaded(outstanding: list[int], start: int) -> int:
    """Index of the minimum, ties broken by the first one at or after ``start``."""
    n = len(outstanding)
    low = min(outstanding)
    for k in range(n):
        i = (start + k) % n
        if outstanding[i] == low:
            return i
    raise AssertionError("unreachable")


class LeastOutstanding(RoutingPolicy):
    name = "least_outstanding"

    def __init__(self, num_replicas: int):
        super().__init__(num_replicas)
        self._tie = 0

    def choose(self, key, outstanding):
        self._check(outstanding)
        replica = _least_loaded(outstanding, self._tie)
        self._tie = (replica + 1) % self.num_replicas
        return replica


class _Node:
    __slots__ = ("edge", "children", "parent", "last_used")

    def __init__(self, edge: Sequence, parent: "_Node | None", last_used: int):
        self.edge = edge                    # elements on the edge from the parent to here
        self.children: dict[Any, _Node] = {}
        self.parent = parent
        self.last_used = last_used


def _common(a: Sequence, a_start: int, b: Sequence) -> int:
    """Length of the common prefix of ``a[a_start:]`` and ``b``."""
    n = min(len(a) - a_start, len(b))
    if a[a_start:a_start + n] == b[:n]:     # fast path: the whole edge matches
        return n
    i = 0
    while i < n and a[a_start + i] == b[i]:
        i += 1
    return i


class PrefixTree:
    """A radix tree of sequences with a size budget and LRU eviction of leaves.

    ``size`` counts stored elements (the sum of edge lengths), so memory stays
    bounded by ``max_size`` whatever the number of keys.
    """

    def __init__(self, max_size: int = 1 << 16):
        if not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_tree_size must be an integer >= 1, got {max_size!r}")
        self.max_size = max_size
        self.root = _Node((), None, 0)
        self.size = 0
        self._clock = itertools.count(1)

    @staticmethod
    def _normalize(key: Sequence) -> Sequence:
        return key if isinstance(key, (str, tuple)) else tuple(key)

    def match(self, key: Sequence) -> int:
        """Length of the longest prefix of ``key`` stored in the tree (read-only)."""
        key = self._normalize(key)
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            k = _common(key, i, child.edge)
            i += k
            if k < len(child.edge):
                break
            node = child
        return i

    def insert(self, key: Sequence) -> None:
        """Record ``key``; touch its path so it is the last to be evicted."""
        key = self._normalize(key)
        now = next(self._clock)
        node, i = self.root, 0
        node.last_used = now
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = _Node(key[i:], node, now)
                node.children[key[i]] = leaf
                self.size += len(leaf.edge)
                break
            k = _common(key, i, child.edge)
            if k < len(child.edge):         # split the edge at the mismatch
                mid = _Node(child.edge[:k], node, now)
                node.children[key[i]] = mid
                child.edge = child.edge[k:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            child.last_used = now
            node, i = child, i + k
        if self.size > self.max_size:
            self._evict()

    def _evict(self) -> None:
        # Down to 90% of the budget at once, so eviction's tree walk is amortized.
        target = self.max_size * 9 // 10
        while self.size > target:
            leaves = sorted(self._leaves(), key=lambda n: n.last_used)
            if not leaves:
                return
            for leaf in leaves:
                if self.size <= target:
                    break
                self._remove_leaf(leaf)

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def _remove_leaf(self, leaf: _Node) -> None:
        parent = leaf.parent
        del parent.children[leaf.edge[0]]
        self.size -= len(leaf.edge)
        # A parent left with one child is merged with it, keeping the tree compact.
        if parent is not self.root and len(parent.children) == 1:
            (only,) = parent.children.values()
            parent.edge = parent.edge + only.edge
            parent.children = only.children
            for c in parent.children.values():
                c.parent = parent
            parent.last_used = max(parent.last_used, only.last_used)


class CacheAware(RoutingPolicy):
    """Longest prefix match, unless the load is imbalanced or the match is short.

    Defaults: ``balance_abs_threshold=8`` requests, ``balance_rel_threshold=1.5``,
    ``min_match_ratio=0.1`` of the key, ``max_tree_size=65536`` elements per
    replica (about a small replica's KV cache, in tokens).
    """
    name = "cache_aware"

    def __init__(self, num_replicas: int, balance_abs_threshold: int = 8,
                 balance_rel_threshold: float = 1.5, min_match_ratio: float = 0.1,
                 max_tree_size: int = 1 << 16):
        super().__init__(num_replicas)
        if not isinstance(balance_abs_threshold, int) or balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be an integer >= 0, "
                             f"got {balance_abs_threshold!r}")
        if not isinstance(balance_rel_threshold, (int, float)) or balance_rel_threshold < 1:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold!r}")
        if not isinstance(min_match_ratio, (int, float)) or not 0 <= min_match_ratio <= 1:
            raise ValueError(f"min_match_ratio must be in [0, 1], got {min_match_ratio!r}")
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.min_match_ratio = min_match_ratio
        self.trees = [PrefixTree(max_tree_size) for _ in range(num_replicas)]
        self._tie = 0
        self.num_by_match = 0       # decisions taken by prefix match (for reports)
        self.num_by_load = 0        # decisions taken by the load guard

    def imbalanced(self, outstanding: list[int]) -> bool:
        hi, lo = max(outstanding), min(outstanding)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def choose(self, key, outstanding):
        self._check(outstanding)
        if len(key) == 0:
            raise ValueError("key must not be empty")
        replica = None
        if not self.imbalanced(outstanding):
            matches = [tree.match(key) for tree in self.trees]
            best = max(matches)
            if best > 0 and best >= self.min_match_ratio * len(key):
                # Longest match; among equal matches the less loaded one.
                replica = min((i for i in range(self.num_replicas) if matches[i] == best),
                              key=lambda i: outstanding[i])
        if replica is None:
            replica = _least_loaded(outstanding, self._tie)
            self._tie = (replica + 1) % self.num_replicas
            self.num_by_load += 1
        else:
            self.num_by_match += 1
        self.trees[replica].insert(key)
        return replica


ROUTING_POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_outstanding": LeastOutstanding,
    "cache_aware": CacheAware,
}


def make_routing_policy(name: str, num_replicas: int, **kwargs) -> RoutingPolicy:
    if name not in ROUTING_POLICIES:
        raise ValueError(f"policy: unknown routing policy {name!r}; "
                         f"choose one of {sorted(ROUTING_POLICIES)}")
    return ROUTING_POLICIES[name](num_replicas, **kwargs)


def request_key(body: dict, chat: bool) -> Sequence:
    """What the router matches on: token ids, or the (rendered) prompt text."""
    if chat:
        from tinyserve.server import _parse_messages, render_chat
        return render_chat(_parse_messages(body.get("messages")))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return tuple(prompt)
    from tinyserve.server import BadRequest
    raise BadRequest("prompt must be a non-empty string or list of token ids", "prompt")


# ---- the HTTP router ------------------------------------------------------------------

POLICY_KEY = web.AppKey("policy", RoutingPolicy)
ROUTED_KEY = web.AppKey("routed", list)


def build_router_app(replicas: list[str], policy: str | RoutingPolicy = "round_robin",
                     **policy_kwargs):
    """An aiohttp app proxying completions to ``replicas`` chosen by ``policy``."""
    from tinyserve.server import BadRequest, error_response

    replicas = [u.rstrip("/") for u in replicas]
    if not replicas:
        raise ValueError("replicas must name at least one URL")
    chooser = (policy if isinstance(policy, RoutingPolicy)
               else make_routing_policy(policy, len(replicas), **policy_kwargs))
    outstanding = [0] * len(replicas)
    routed = [0] * len(replicas)
    app = web.Application(client_max_size=16 * 2**20)
    session_box: list[aiohttp.ClientSession] = []

    async def open_session(app):
        # No connection limit: the replicas' own queues decide how many run.
        session_box.append(aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)))

    async def close_session(app):
        await session_box[0].close()

    async def proxy(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        raw = await request.read()
        try:
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise BadRequest(f"request body is not valid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise BadRequest("request body must be a JSON object")
            key = request_key(body, chat)
        except BadRequest as exc:
            return exc.response()
        replica = chooser.choose(key, list(outstanding))
        outstanding[replica] += 1
        routed[replica] += 1
        response = None
        try:
            async with session_box[0].post(replicas[replica] + request.path, data=raw,
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
            return error_response(f"replica {replicas[replica]} failed: {exc}", None, 502,
                                  "bad_gateway")
        finally:
            outstanding[replica] -= 1
            chooser.on_finish(replica, key)

    async def health(request):
        return web.json_response({"status": "ok", "policy": chooser.name, "replicas": replicas})

    async def models(request):
        async with session_box[0].get(replicas[0] + "/v1/models") as up:
            return web.Response(body=await up.read(), status=up.status,
                                content_type="application/json")

    async def metrics(request):
        lines = ["# HELP tinyserve_router:requests_routed_total Requests sent to each replica.",
                 "# TYPE tinyserve_router:requests_routed_total counter"]
        lines += [f'tinyserve_router:requests_routed_total{{replica="{u}"}} {routed[i]}'
                  for i, u in enumerate(replicas)]
        lines += ["# HELP tinyserve_router:requests_outstanding Requests in flight per replica.",
                  "# TYPE tinyserve_router:requests_outstanding gauge"]
        lines += [f'tinyserve_router:requests_outstanding{{replica="{u}"}} {outstanding[i]}'
                  for i, u in enumerate(replicas)]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_post("/v1/completions", proxy)
    app.router.add_post("/v1/chat/completions", proxy)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app[POLICY_KEY] = chooser
    app[ROUTED_KEY] = routed
    return app


def route(replicas: list[str], policy: str = "round_robin", host: str = "127.0.0.1",
          port: int = 8000, **policy_kwargs) -> None:
    app = build_router_app(replicas, policy, **policy_kwargs)
    print(f"tinyserve router ({policy}) on http://{host}:{port} over {len(replicas)} replicas",
          flush=True)
    web.run_app(app, host=host, port=port, handler_cancellation=True, print=None,
                access_log=None, shutdown_timeout=5.0)


# ---- the benchmark: routing policies compared on real replicas ------------------------

async def _replica_counters(session, urls: list[str]) -> tuple[float, float]:
    from tinyserve.server import parse_prometheus
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
    from tinyserve.client import run_benchmark
    from tinyserve.server import free_port

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
    from tinyserve.client import build_prompts
    from tinyserve.workload import make_workload

    def specs_for(k: int):
        specs = make_workload(workload, num_requests=num_requests, rate=rate, seed=seed + k,
                              **workload_kwargs)
        return specs, build_prompts(specs, seed=seed + k)
    return specs_for


def bench_routing(num_replicas: int = 3, model: str = "tiny", replica_args: Sequence[str] = (),
                  replicas: list[str] | None = None, **kwargs) -> list[dict]:
    """Start ``num_replicas`` servers (unless ``replicas`` are given), compare the policies."""
    from tinyserve.server import launch_servers
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

