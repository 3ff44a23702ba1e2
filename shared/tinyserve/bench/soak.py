"""Soak: rounds of concurrent streams (and hostile requests) against one server, with
the server's RSS and KV blocks measured after every round.

    python -m tinyserve.bench soak                        # starts `tinyserve serve --model tiny`
    python -m tinyserve.bench soak --rounds 3 --streams 200 --max-tokens 32
    python -m tinyserve.bench soak --url http://127.0.0.1:8000 --pid 4242   # a running server

Each round sends ``streams`` streaming completions at once (distinct prompts,
``ignore_eos``, so each must produce exactly ``max_tokens`` tokens and end with
``[DONE]``). With ``--hostile`` (the default) every round also sends, alongside
them, what issue 16 found broke the server: 10 MB prompts, temperature 1e-300,
seeds >= 2**64, deeply nested JSON, unsupported parameters, and clients that
disconnect mid-stream. Each must get its expected answer (a 400/413, a served
greedy answer, a clean abort) while the streams finish untouched.

After each round the server must be idle with every KV block free; the RSS of
the server process is read (``psutil``) once it is. The check (exit code 1 when
it fails): no errors, every hostile request answered as expected, all blocks
free, and RSS growth from the second-to-last to the last round under
``--max-growth-mb`` (5 MB): a server that leaks grows every round, one that
only warms up stops growing after the first.
"""

from __future__ import annotations

import asyncio
import json
import time


def _prompt(i: int) -> list[int]:
    """A distinct 6-token prompt for stream ``i`` (a short shared tail, as chat traffic has)."""
    return [10 + i % 1500, 20 + i % 7, 30, 40 + i % 3, 50, 60]


async def _stream(session, url: str, body: dict, max_tokens: int | None = None) -> str | None:
    """POST a streaming request; None if it ended as asked (``[DONE]``, and ``max_tokens``
    tokens when given), else what went wrong."""
    from tinyserve.serving.client import iter_sse
    try:
        async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
            if r.status != 200:
                return f"HTTP {r.status}"
            tokens, done = 0, False
            async for data in iter_sse(r):
                if data == "[DONE]":
                    done = True
                    break
                payload = json.loads(data)
                if "error" in payload:
                    return f"error event: {payload['error'].get('message')}"
                tokens += len(payload.get("choices") or [])
            if not done:
                return "no [DONE]"
            if max_tokens is not None and tokens != max_tokens:
                return f"{tokens} tokens, not {max_tokens}"
            return None
    except Exception as exc:                    # noqa: BLE001 (counted, not raised)
        return f"{type(exc).__name__}: {exc}"


async def _status(session, url: str, raw: bytes, want: int) -> str | None:
    try:
        async with session.post(url + "/v1/completions", data=raw,
                                headers={"Content-Type": "application/json"}) as r:
            body = await r.read()
            if r.status != want:
                return f"HTTP {r.status}, wanted {want}"
            if want >= 400 and b'"error"' not in body:
                return f"HTTP {r.status} without OpenAI error JSON"
            return None
    except Exception as exc:                    # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


async def hang_up_mid_stream(session, url: str, body: dict, events: int = 3) -> None:
    """POST ``body`` as a streaming completion, read ``events`` events, then drop the
    connection (the server must abort the request and free its blocks)."""
    from tinyserve.serving.client import iter_sse
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        seen = 0
        async for _ in iter_sse(r):
            seen += 1
            if seen == events:
                break
        r.close()


async def _disconnect(session, url: str) -> str | None:
    await hang_up_mid_stream(session, url, {"prompt": [7, 8, 9], "max_tokens": 200,
                                            "ignore_eos": True})
    return None


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


def _hostile(session, url: str, round_index: int) -> list:
    """Coroutines of the hostile requests of one round (each returns None when answered right)."""
    big = json.dumps({"prompt": "\n" * round_index + " " * 10_000_000}).encode()
    nested = b"[" * 100_000 + b"]" * 100_000
    greedy = {"prompt": [3, 4, 5], "max_tokens": 8, "ignore_eos": True}
    return [_status(session, url, big, 413), _status(session, url, big, 413),
            _status(session, url, nested, 400),
            _status(session, url, _json({"prompt": "hi", "frequency_penalty": 1}), 400),
            _status(session, url, _json({"prompt": "hi", "max_tokens": 10**30}), 400),
            _stream(session, url, {**greedy, "temperature": 1e-300}, 8),
            _stream(session, url, {**greedy, "temperature": 1.0, "seed": 2**64 + round_index}, 8),
            _disconnect(session, url), _disconnect(session, url)]


async def wait_idle(session, url: str, timeout: float = 60.0) -> dict:
    """``/debug/engine`` once nothing is waiting or running."""
    deadline = time.monotonic() + timeout
    while True:
        async with session.get(url + "/debug/engine") as r:
            snap = await r.json()
        if snap["num_running"] == 0 and snap["num_waiting"] == 0:
            return snap
        if time.monotonic() > deadline:
            raise TimeoutError(f"server still busy after {timeout} s: {snap}")
        await asyncio.sleep(0.05)


async def soak_async(url: str, pid: int | None = None, rounds: int = 3, streams: int = 200,
                     max_tokens: int = 16, hostile: bool = True, settle: float = 0.3) -> list[dict]:
    """Run the rounds; one row per round (see the module docstring)."""
    import aiohttp
    import psutil

    if rounds < 1 or streams < 1 or max_tokens < 1:
        raise ValueError("rounds, streams and max_tokens must be >= 1")
    url = url.rstrip("/")
    proc = psutil.Process(pid) if pid is not None else None
    rows = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for k in range(rounds):
            bodies = [{"prompt": _prompt(k * streams + i), "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0} for i in range(streams)]
            extras = _hostile(session, url, k) if hostile else []
            started = time.perf_counter()
            results = await asyncio.gather(*[_stream(session, url, b, max_tokens) for b in bodies],
                                           *extras)
            seconds = time.perf_counter() - started
            snap = await wait_idle(session, url)
            await asyncio.sleep(settle)
            errors = [r for r in results[:streams] if r is not None]
            bad = [r for r in results[streams:] if r is not None]
            rows.append({"round": k + 1, "streams": streams, "seconds": seconds,
                         "errors": len(errors), "first_error": (errors or bad or [None])[0],
                         "hostile": len(extras), "hostile_failed": len(bad),
                         "free_blocks": snap["num_free_blocks"], "num_blocks": snap["num_blocks"],
                         "integrity": snap["integrity"],
                         "rss_mb": proc.memory_info().rss / 2**20 if proc else float("nan")})
    return rows


def check_soak(rows: list[dict], max_growth_mb: float = 5.0) -> list[str]:
    """What failed (empty: the soak passed)."""
    problems = []
    for r in rows:
        if r["errors"] or r["hostile_failed"]:
            problems.append(f"round {r['round']}: {r['errors']} stream errors, "
                            f"{r['hostile_failed']} hostile requests answered wrong "
                            f"(first: {r['first_error']})")
        if r["free_blocks"] != r["num_blocks"] or r["integrity"] != "ok":
            problems.append(f"round {r['round']}: {r['free_blocks']}/{r['num_blocks']} blocks "
                            f"free, integrity {r['integrity']}")
    if len(rows) >= 2:
        growth = rows[-1]["rss_mb"] - rows[-2]["rss_mb"]
        if growth >= max_growth_mb:
            problems.append(f"RSS grew {growth:.1f} MB from round {len(rows) - 1} to "
                            f"{len(rows)} (limit {max_growth_mb} MB)")
    return problems


def format_soak(rows: list[dict]) -> str:
    lines = [f"{'round':>5} {'streams':>8} {'seconds':>8} {'errors':>7} {'hostile ok':>11} "
             f"{'blocks free':>12} {'RSS MB':>8} {'growth':>7}"]
    for i, r in enumerate(rows):
        growth = r["rss_mb"] - rows[i - 1]["rss_mb"] if i else float("nan")
        lines.append(f"{r['round']:>5} {r['streams']:>8} {r['seconds']:>8.1f} {r['errors']:>7} "
                     f"{r['hostile'] - r['hostile_failed']:>5}/{r['hostile']:<5} "
                     f"{r['free_blocks']:>5}/{r['num_blocks']:<6} {r['rss_mb']:>8.1f} "
                     f"{growth:>+7.1f}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--pid", type=int, default=None, help="its process id, for RSS (with --url)")
    p.add_argument("--model", default="tiny", help="model of the server started (default tiny)")
    p.add_argument("--server-args", default="--threads 1 --max-num-seqs 32",
                   help="extra `tinyserve serve` arguments for the server started")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=200, help="concurrent streams per round")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-hostile", dest="hostile", action="store_false",
                   help="streams only, no hostile requests")
    p.add_argument("--max-growth-mb", type=float, default=5.0)


def main(args) -> int:
    import shlex
    from tinyserve.serving.processes import ServerProcess

    server = None
    url, pid = args.url, args.pid
    if url is None:
        server = ServerProcess(["serve", "--model", args.model, *shlex.split(args.server_args)])
        server.wait()
        url, pid = server.url, server.process.pid
    try:
        rows = asyncio.run(soak_async(url, pid, args.rounds, args.streams, args.max_tokens,
                                      args.hostile))
    finally:
        if server is not None:
            server.stop()
    print(format_soak(rows))
    problems = check_soak(rows, args.max_growth_mb)
    print("\n".join(problems) if problems else
          f"soak passed: no errors, every hostile request answered as expected, all blocks "
          f"free, RSS growth round {len(rows) - 1} -> {len(rows)} under {args.max_growth_mb} MB")
    return 1 if problems else 0
