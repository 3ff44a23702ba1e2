"""Routing policies (pure decisions) and the streaming HTTP router over real replicas."""

import asyncio
import json
import random
import time

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tinyserve.bench.soak import hang_up_mid_stream
from tinyserve.serving.client import iter_sse
from tinyserve.serving.scrape import parse_metrics
from tinyserve.serving.router import (RouterConfig, build_router_app, compare_policies_async,
                                      shared_prefix_runs)
from tinyserve.routing import (ROUTING_POLICIES, CacheAware, LeastOutstanding, PrefixTree,
                           RoundRobin, cache_aware_choice, make_routing_policy)
from tinyserve.serving.processes import ServerProcess, free_port, launch_servers

from server_harness import Background

# ---- pure policies ----------------------------------------------------------------


def test_round_robin_ignores_load():
    p = RoundRobin(3)
    assert [p.choose((1,), [9, 0, 0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_outstanding_picks_minimum_and_rotates_ties():
    p = LeastOutstanding(3)
    assert p.choose((1,), [5, 2, 7]) == 1
    assert p.choose((1,), [5, 9, 1]) == 2
    # All equal: ties go round-robin from after the last choice, so an idle fleet spreads.
    assert [p.choose((1,), [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]


def test_cache_aware_ties_rotate_but_the_rule_takes_the_first_from_its_start():
    # Unrelated short keys on an idle fleet: every decision is the load fallback, a tie of all.
    keys = [(1000 + k,) for k in range(4)]
    rotating = CacheAware(3)
    assert [rotating.choose(k, [0, 0, 0]) for k in keys] == [0, 1, 2, 0]
    trees = [PrefixTree(64) for _ in range(3)]
    assert cache_aware_choice((2000,), [0, 0, 0], trees, 8, 1.5, 0.1) == (0, False)
    assert cache_aware_choice((2000,), [4, 1, 1], trees, 8, 1.5, 0.1) == (1, False)   # smaller of the least loaded
    assert cache_aware_choice((2000,), [1, 1, 0], trees, 8, 1.5, 0.1, tie_start=1) == (2, False)
    assert all(t.size == 0 for t in trees)                    # the rule reads the trees only


def test_cache_aware_follows_the_longest_prefix():
    p = CacheAware(3)
    sys_a, sys_b = tuple(range(100, 164)), tuple(range(500, 564))
    first = p.choose(sys_a + (1, 2), [0, 0, 0])
    assert first == 0                               # empty trees: least loaded, first tie
    second = p.choose(sys_b + (3,), [1, 0, 0])
    assert second == 1                              # no match: least loaded
    # Same system prompt as the first: back to replica 0, although it is busier.
    assert p.choose(sys_a + (7, 8, 9), [3, 0, 1]) == 0
    assert p.choose(sys_b + (4, 4), [3, 1, 0]) == 1
    assert p.num_by_match == 2 and p.num_by_load == 2


def test_cache_aware_load_guard_wins_over_the_match():
    p = CacheAware(3, balance_abs_threshold=4, balance_rel_threshold=1.5)
    key = tuple(range(50))
    assert p.choose(key, [0, 0, 0]) == 0
    # max - min = 5 > 4 and 5 > 1.5 * 0: imbalanced, so the least loaded replica.
    assert p.choose(key, [5, 0, 2]) == 1
    # Now replica 1's tree holds the key too; with balanced load the match decides,
    # and the less loaded of the equal matches wins.
    assert p.choose(key, [3, 2, 0]) == 1
    # Within the absolute threshold the match still wins.
    assert p.choose(key, [4, 4, 0]) == 0


def test_cache_aware_short_match_goes_to_least_loaded():
    p = CacheAware(2, min_match_ratio=0.5)
    p.choose((1, 2, 3, 4), [0, 0])                  # recorded on replica 0
    # Shares 2 of 10 elements (< 50%): treated as no match.
    assert p.choose((1, 2) + tuple(range(90, 98)), [1, 0]) == 1
    # Shares 4 of 6 (>= 50%): follows the match.
    assert p.choose((1, 2, 3, 4, 5, 6), [1, 0]) == 0


def test_cache_aware_works_on_strings():
    p = CacheAware(2)
    assert p.choose("system: you are kind\nuser: hi", [0, 0]) == 0
    assert p.choose("something else entirely", [1, 0]) == 1
    assert p.choose("system: you are kind\nuser: bye", [1, 0]) == 0


def test_prefix_tree_matches_like_brute_force():
    rng = random.Random(0)
    tree, keys = PrefixTree(max_size=10**9), []
    for _ in range(300):
        if keys and rng.random() < 0.5:             # extend an existing key's prefix
            base = rng.choice(keys)
            key = base[:rng.randint(0, len(base))] + tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 6)))
        else:
            key = tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 12)))
        probe = tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 12)))

        def lcp(a, b):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            return n
        assert tree.match(probe) == max((lcp(probe, k) for k in keys), default=0)
        tree.insert(key)
        keys.append(key)
        assert tree.match(key) == len(key)
    # size = number of distinct non-empty prefixes (one element per trie edge).
    assert tree.size == len({k[:i] for k in keys for i in range(1, len(k) + 1)})


def test_prefix_tree_budget_and_lru_eviction():
    tree = PrefixTree(max_size=100)
    old, fresh = tuple(range(0, 40)), tuple(range(1000, 1040))
    tree.insert(old)
    tree.insert(fresh)
    tree.match(old)                                 # match does not count as use
    tree.insert(fresh)                              # touch: `fresh` is now the newest
    tree.insert(tuple(range(2000, 2040)))           # 120 > 100: evict down to <= 90
    assert tree.size <= 100
    assert tree.match(old) == 0                     # least recently used went first
    assert tree.match(fresh) == 40
    for k in range(50):                             # stays bounded whatever is inserted
        tree.insert(tuple(range(k * 100, k * 100 + 30)))
        assert tree.size <= 100


def test_make_routing_policy_and_errors():
    assert set(ROUTING_POLICIES) == {"round_robin", "least_outstanding", "cache_aware"}
    for name in ROUTING_POLICIES:
        assert make_routing_policy(name, 4).name == name
    with pytest.raises(ValueError, match="policy: unknown routing policy 'random'"):
        make_routing_policy("random", 3)
    with pytest.raises(ValueError, match="num_replicas must be an integer >= 1"):
        make_routing_policy("round_robin", 0)
    with pytest.raises(ValueError, match="outstanding has 2 entries for 3 replicas"):
        make_routing_policy("least_outstanding", 3).choose((1,), [0, 0])
    with pytest.raises(ValueError, match="min_match_ratio must be in"):
        make_routing_policy("cache_aware", 3, min_match_ratio=2)
    with pytest.raises(ValueError, match="key must not be empty"):
        make_routing_policy("cache_aware", 3).choose((), [0, 0, 0])


# ---- the HTTP router over three real replicas ---------------------------------------


@pytest.fixture(scope="module")
def replicas():
    # A small KV cache (48 blocks of 16 tokens) so that one replica cannot hold
    # every group's prefix: where requests go decides what gets reused.
    procs = launch_servers(3, "tiny", ["--threads", "1", "--num-kv-blocks", "48"])
    try:
        yield [p.url for p in procs]
    finally:
        for p in procs:
            p.stop()


def _run_router(replicas, policy, body_fn):
    """Start an in-process router, run ``body_fn(session, router_url, app)``."""
    async def main():
        app = build_router_app(replicas, policy)
        srv = TestServer(app)
        await srv.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                return await body_fn(s, str(srv.make_url("")).rstrip("/"), app)
        finally:
            await srv.close()
    return asyncio.run(main())


def test_router_streams_through_and_counts(replicas):
    body = {"prompt": [10, 20, 30, 40], "max_tokens": 6, "ignore_eos": True, "temperature": 0}

    async def go(s, url, app):
        streams = []
        for _ in range(3):
            chunks = []
            async with s.post(url + "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                async for data in iter_sse(r):
                    chunks.append(data)
            streams.append(chunks)
        async with s.post(replicas[0] + "/v1/completions", json=body) as r:
            direct = await r.json()
        async with s.post(url + "/v1/completions", data=b"{oops") as r:
            bad = (r.status, await r.json())
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
        return streams, direct, bad, metrics

    streams, direct, bad, metrics = _run_router(replicas, "round_robin", go)
    for chunks in streams:
        assert chunks[-1] == "[DONE]"
        text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1])
        assert text == direct["choices"][0]["text"]     # same weights on every replica
    assert bad[0] == 400 and bad[1]["error"]["type"] == "invalid_request_error"
    for u in replicas:                                  # round robin: one each
        assert f'tinyserve_router:requests_routed_total{{replica="{u}"}} 1' in metrics
        assert f'tinyserve_router:requests_outstanding{{replica="{u}"}} 0' in metrics
    # The scrape parser the book uses keeps the router's names as they are (they hold a ':', so
    # no OpenMetrics escaping is undone in them).
    scraped = parse_metrics(metrics, "router")
    assert scraped.series("tinyserve_router:requests_routed_total") == [({"replica": u}, 1.0) for u in replicas]
    assert scraped.series("tinyserve_router:request_retries_total") == [({}, 0.0)]


def test_router_disconnect_reaches_the_replica(replicas):
    async def go(s, url, app):
        async def aborts():
            total = 0
            for u in replicas:
                async with s.get(u + "/debug/engine") as r:
                    total += (await r.json())["request_abort_total"]
            return total
        before = await aborts()
        await hang_up_mid_stream(s, url, {"prompt": [7, 8, 9], "max_tokens": 500,
                                          "ignore_eos": True}, events=1)
        deadline = time.monotonic() + 30
        while await aborts() == before:
            assert time.monotonic() < deadline, "replica never saw the abort"
            await asyncio.sleep(0.05)
        return await aborts() - before

    assert _run_router(replicas, "least_outstanding", go) == 1


def test_cache_aware_about_doubles_prefix_hit_rate(replicas):
    # 12 prefix groups of 128 shared tokens (8 blocks), 36 requests: round robin
    # scatters each group over all 3 replicas, cache-aware keeps it on one. Each group
    # has 3 requests: cache-aware hits on 2 of them, round robin on about 1, so the
    # ratio is about 2; the load guard sometimes sends a request elsewhere (timing),
    # hence the margin below 2.
    specs_for = shared_prefix_runs("shared-prefix", num_requests=36, rate=30.0, seed=11,
                                   max_len=512, length_scale=0.25, num_prefix_groups=12)
    rows = asyncio.run(compare_policies_async(replicas, specs_for,
                                              policies=("round_robin", "cache_aware")))
    rr, ca = rows
    assert rr["errors"] == ca["errors"] == 0
    assert rr["completed"] == ca["completed"] == 36
    assert ca["prefix_cache_hit_rate"] >= 1.75 * rr["prefix_cache_hit_rate"] > 0


# ---- failover: health probes, retries, timeouts, a replica killed mid-stream -------------

REPLICA_ARGS = ["serve", "--model", "tiny", "--threads", "1"]
FAST = RouterConfig(health_interval=0.2, health_timeout=1.0, unhealthy_after=1, healthy_after=1,
                    read_timeout=30.0)


def background_router(replicas, policy="round_robin", config=FAST):
    """A router on its own event-loop thread (blocking clients such as the openai SDK)."""
    return Background(build_router_app(replicas, policy, config), **config.runner_kwargs())


def _health(url):
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                return r.status, await r.json()
    return asyncio.run(main())


def _wait_health(url, want, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        status, body = _health(url)
        if [r["healthy"] for r in body["replicas"]] == want:
            return status, body
        assert time.monotonic() < deadline, body
        time.sleep(0.05)


async def _events(s, url, body, until=None):
    """Stream through the router: (status, replica, parsed events, saw [DONE]); ``until``
    (an asyncio.Event) is set after the third event."""
    events, done = [], False
    async with s.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        replica = int(r.headers["X-Tinyserve-Replica"])
        async for data in iter_sse(r):
            if data == "[DONE]":
                done = True
                break
            events.append(json.loads(data))
            if until is not None and len(events) == 3:
                until.set()
    return r.status, replica, events, done


def test_a_replica_killed_mid_stream(tmp_path):
    procs = launch_servers(2, "tiny", ["--threads", "1"])
    router = background_router([p.url for p in procs])
    try:
        body = {"prompt": [10, 11, 12], "max_tokens": 450, "ignore_eos": True, "temperature": 0}

        async def cut_streams():
            async with aiohttp.ClientSession() as s:
                started = [asyncio.Event() for _ in range(4)]
                tasks = [asyncio.create_task(_events(s, router.url, body, e)) for e in started]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                procs[0].process.kill()                 # no SIGTERM: the replica just dies
                procs[0].process.wait()
                return await asyncio.gather(*tasks)
        results = asyncio.run(cut_streams())
        on = {0: [r for r in results if r[1] == 0], 1: [r for r in results if r[1] == 1]}
        assert len(on[0]) == len(on[1]) == 2            # round robin
        for status, _, events, done in on[0]:
            # HTTP 200 was sent long before; the stream must not look complete.
            assert status == 200 and done
            assert "error" in events[-1] and events[-1]["error"]["type"] == "bad_gateway"
            assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
        for status, _, events, done in on[1]:
            assert status == 200 and done and len(events) == 450
            assert events[-1]["choices"][0]["finish_reason"] == "length"

        # Ejected: /health says so, every request goes to the live replica, and
        # /v1/models answers although replica 0 (the one it used to ask) is down.
        status, health = _wait_health(router.url, [False, True])
        assert status == 200 and health["status"] == "degraded" and health["num_healthy"] == 1
        client = router.sdk()
        for _ in range(6):
            out = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].finish_reason == "length"
        assert client.models.list().data[0].id == "tiny"

        # Back on the same port: re-admitted.
        procs[0] = ServerProcess(REPLICA_ARGS, port=procs[0].port).wait()
        status, health = _wait_health(router.url, [True, True])
        assert health["status"] == "ok" and health["replicas"][0]["ejections"] == 1

        # What the openai SDK sees when its replica dies mid-stream: an exception, never a
        # short answer with finish_reason None.
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=[10, 11, 12], max_tokens=450, stream=True,
            extra_body={"ignore_eos": True})
        victim = int(raw.headers["X-Tinyserve-Replica"])
        stream, seen = raw.parse(), 0
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            for _ in stream:
                seen += 1
                if seen == 3:
                    procs[victim].process.kill()
        assert 3 <= seen < 450
    finally:
        router.close()
        for p in procs:
            p.stop()


def test_no_replica_up_is_503_on_every_endpoint_and_bad_bodies_stay_400():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    router = background_router(dead)
    try:
        client = router.sdk()
        with pytest.raises(openai.APIStatusError) as first:     # probed or not yet: no one is up
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert first.value.status_code == 503
        status, health = _wait_health(router.url, [False, False])
        assert status == 503 and health["status"] == "unavailable"

        async def post(path, raw):
            async with aiohttp.ClientSession() as s:
                async with s.post(router.url + path, data=raw,
                                  headers={"Content-Type": "application/json"}) as r:
                    return r.status, await r.json()

        async def models():
            async with aiohttp.ClientSession() as s:
                async with s.get(router.url + "/v1/models") as r:
                    return r.status, await r.json()
        status, listed = asyncio.run(models())
        assert status == 503
        for path, body in (("/v1/completions", {"prompt": [1, 2], "stream": True}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]})):
            status, answer = asyncio.run(post(path, json.dumps(body).encode()))
            assert status == 503 and set(answer) == {"error"}, answer
            error = answer["error"]
            assert set(error) == set(listed["error"])              # OpenAI's error object
            assert (error["type"], error["code"], error["param"]) == ("service_unavailable",
                                                                     503, None)
            assert all(u in error["message"] for u in dead)
        with pytest.raises(openai.APIStatusError) as chat:
            client.chat.completions.create(model="tiny", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
        assert chat.value.status_code == 503
        # The router refuses a bad body itself, with or without replicas, naming the field.
        status, answer = asyncio.run(post("/v1/completions", b'{"prompt": "a", "top_p": NaN}'))
        assert status == 400 and answer["error"]["param"] == "top_p"
    finally:
        router.close()


def test_a_connect_failure_is_retried_on_another_replica(replicas):
    dead = f"http://127.0.0.1:{free_port()}"
    # Slow probes: the dead replica is still "healthy" when the first request picks it.
    config = RouterConfig(health_interval=60, unhealthy_after=2)
    router = background_router([dead, replicas[0]], "round_robin", config)
    try:
        client = router.sdk()
        for _ in range(4):
            # ignore_eos: a sampled end-of-text would also end the answer early (it did, once).
            out = client.completions.create(model="tiny", prompt=[4, 5, 6], max_tokens=2,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].finish_reason == "length"
        status, health = _health(router.url)
        assert [r["healthy"] for r in health["replicas"]] == [False, True]
        assert health["replicas"][0]["ejections"] == 1

        async def metrics():
            async with aiohttp.ClientSession() as s:
                async with s.get(router.url + "/metrics") as r:
                    return await r.text()
        assert "tinyserve_router:request_retries_total 1" in asyncio.run(metrics())
    finally:
        router.close()


def test_upstream_read_timeout():
    """A replica that accepts and then says nothing: a 504 before any byte, an error event
    after some."""
    release = asyncio.Event()

    async def silent(request):
        body = await request.json()
        if not body.get("stream"):
            await release.wait()
            return web.json_response({})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(2):
            await response.write(b'data: {"choices": [{"index": 0, "text": "x", '
                                 b'"finish_reason": null}]}\n\n')
        await release.wait()
        return response

    async def ok(request):
        return web.json_response({"status": "ok"})

    async def main():
        fake = web.Application()
        fake.router.add_post("/v1/completions", silent)
        fake.router.add_get("/health", ok)
        upstream = TestServer(fake, host="127.0.0.1")
        await upstream.start_server()
        router = TestServer(build_router_app([str(upstream.make_url("")).rstrip("/")], "round_robin",
                                             RouterConfig(read_timeout=0.5)), host="127.0.0.1")
        await router.start_server()
        url = str(router.make_url("")).rstrip("/")
        try:
            async with aiohttp.ClientSession() as s:
                t0 = time.monotonic()
                async with s.post(url + "/v1/completions", json={"prompt": "hi"}) as r:
                    whole = (r.status, await r.json(), time.monotonic() - t0)
                t0 = time.monotonic()
                status, _, events, done = await _events(s, url, {"prompt": "hi"})
                streamed = (status, events, done, time.monotonic() - t0)
        finally:
            release.set()
            await router.close()
            await upstream.close()
        return whole, streamed

    whole, streamed = asyncio.run(main())
    assert whole[0] == 504 and whole[1]["error"]["type"] == "gateway_timeout" and whole[2] < 5
    status, events, done, seconds = streamed
    assert status == 200 and done and seconds < 5
    assert len(events) == 3 and "sent nothing" in events[-1]["error"]["message"]
