"""An open-loop load generator for OpenAI-compatible servers.

    tinyserve bench serve --url http://127.0.0.1:8000 --workload shared-prefix \\
        --rate 8 --num-requests 64 --ttft-slo 0.5 --tpot-slo 0.05 --out result.json

Requests are sent at the workload's arrival times whether or not earlier ones
have finished (open loop: a slow server builds a queue, as with real users).
Every request streams, and the client times what comes off the wire, with the
definitions of vLLM's serving benchmark (see ``tinyserve.metrics``):

* TTFT: first streamed chunk - send time; ITL: gaps between chunks;
* E2E: last chunk - send time; TPOT: (E2E - TTFT) / (output tokens - 1),
  output tokens taken from the server's ``usage`` (``stream_options``);
* goodput: completed requests per second that met every SLO given.

Only standard OpenAI fields plus ``ignore_eos`` are sent, so the same command
measures vLLM, SGLang or TensorRT-LLM serving an OpenAI-compatible endpoint:
prompts go out as token-id lists, which their ``/v1/completions`` accept.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from tinyserve.metrics import RequestMetrics, summarize


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds on ``time.perf_counter``)."""
    index: int
    send_time: float
    prompt_len: int
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    def metrics(self) -> RequestMetrics:
        done = self.error is None and bool(self.chunk_times)
        return RequestMetrics(
            arrival_time=self.send_time, first_scheduled_time=None,
            first_token_time=self.chunk_times[0] if self.chunk_times else None,
            finished_time=self.chunk_times[-1] if done else None,
            token_times=list(self.chunk_times), num_prompt_tokens=self.prompt_len,
            num_output_tokens=self.output_tokens)


def build_prompts(specs: Sequence, seed: int = 0) -> list[list[int]]:
    from tinyserve.workload import prompt_token_ids
    return [prompt_token_ids(spec, i, seed=seed) for i, spec in enumerate(specs)]


async def get_model_name(session, url: str) -> str:
    """The first model a server lists (what vLLM's benchmark does without --model)."""
    async with session.get(url.rstrip("/") + "/v1/models") as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def iter_sse(response):
    """Yield the ``data:`` payloads of a server-sent-event stream, as they arrive."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode()


async def send_request(session, url: str, body: dict, result: RequestResult, chat: bool) -> None:
    """Stream one request, recording the arrival time of every chunk."""
    result.send_time = time.perf_counter()
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return
            pieces = []
            async for data in iter_sse(r):
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                payload = json.loads(data)
                if "error" in payload:
                    result.error = str(payload["error"].get("message", payload["error"]))
                    return
                if payload.get("choices"):
                    choice = payload["choices"][0]
                    # Every chunk with a choice counts as a token arrival (as in vLLM's
                    # benchmark), even one whose text is empty (half a UTF-8 character).
                    result.chunk_times.append(now)
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    pieces.append(piece or "")
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
                if payload.get("usage"):
                    result.output_tokens = payload["usage"].get("completion_tokens") or 0
            result.text = "".join(pieces)
            if not result.output_tokens:        # a server that sends no usage
                result.output_tokens = len(result.chunk_times)
            if not result.chunk_times:
                result.error = "no tokens received"
    except asyncio.CancelledError:
        raise
    except Exception as exc:                    # connection errors count, they do not crash
        result.error = f"{type(exc).__name__}: {exc}"


def _body(prompt, spec, model: str, chat: bool, extra: dict | None) -> dict:
    body = {"model": model, "max_tokens": spec.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(extra or {})
    return body


async def run_benchmark(url: str, specs: Sequence, *, prompts: Sequence | None = None,
                        model: str | None = None, endpoint: str = "/v1/completions",
                        seed: int = 0, ttft_slo: float | None = None,
                        tpot_slo: float | None = None, e2e_slo: float | None = None,
                        max_concurrency: int | None = None, progress: bool = True,
                        extra_body: dict | None = None, timeout: float = 6 * 3600) -> dict:
    """Replay ``specs`` (``tinyserve.workload.RequestSpec``) against ``url``; return the summary.

    ``prompts`` default to ``workload.prompt_token_ids(spec, i, seed)``; for the
    chat endpoint they are decoded to text with tinyserve's tokenizer.
    """
    import aiohttp
    from tqdm.auto import tqdm

    _check_benchmark_args(specs, max_concurrency)
    chat = endpoint.rstrip("/").endswith("chat/completions")
    prompts = _benchmark_prompts(specs, prompts, seed, chat)
    url = url.rstrip("/")
    results = [RequestResult(i, 0.0, s.prompt_len) for i, s in enumerate(specs)]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), desc="bench", unit="req", disable=not progress)
    connector = aiohttp.TCPConnector(limit=0)       # open loop: never queue in the client
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        if model is None:
            model = await get_model_name(session, url)

        def body_for(i: int) -> dict:
            return _body(prompts[i], specs[i], model, chat, extra_body)
        duration = await _replay(session, url + endpoint, specs, body_for, results, chat, limit,
                                 bar)
    bar.close()
    return _benchmark_summary(results, duration, url, endpoint, model,
                              ttft_slo=ttft_slo, tpot_slo=tpot_slo, e2e_slo=e2e_slo)


def _check_benchmark_args(specs: Sequence, max_concurrency: int | None) -> None:
    if not specs:
        raise ValueError("specs must not be empty")
    if max_concurrency is not None and (not isinstance(max_concurrency, int) or max_concurrency < 1):
        raise ValueError(f"max_concurrency must be an integer >= 1, got {max_concurrency!r}")


def _benchmark_prompts(specs: Sequence, prompts: Sequence | None, seed: int, chat: bool) -> list:
    """One prompt per spec: given or built from the workload; text for the chat endpoint."""
    prompts = list(prompts) if prompts is not None else build_prompts(specs, seed)
    if len(prompts) != len(specs):
        raise ValueError(f"prompts: got {len(prompts)} for {len(specs)} specs")
    if chat:
        from tinyserve.tokenizer import load_default_tokenizer
        tok = load_default_tokenizer()
        prompts = [p if isinstance(p, str) else tok.decode(p) for p in prompts]
    return prompts


async def _replay(session, target: str, specs: Sequence, body_for, results: list[RequestResult],
                  chat: bool, limit: asyncio.Semaphore | None, bar) -> float:
    """Send request ``i`` at ``specs[i].arrival`` seconds after the start (open loop: without
    waiting for earlier ones), wait for them all; return the seconds that took."""
    async def one(i: int) -> None:
        body = body_for(i)
        if limit is None:
            await send_request(session, target, body, results[i], chat)
        else:
            async with limit:
                await send_request(session, target, body, results[i], chat)
        bar.update(1)

    start = time.perf_counter()
    tasks = []
    for i, spec in enumerate(specs):
        delay = start + spec.arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return time.perf_counter() - start


def _benchmark_summary(results: list[RequestResult], duration: float, url: str, endpoint: str,
                       model: str, *, ttft_slo: float | None, tpot_slo: float | None,
                       e2e_slo: float | None) -> dict:
    """``metrics.summarize`` of what the client saw, plus the run's settings and every request."""
    summary = summarize([r.metrics() for r in results], duration=duration,
                        ttft_slo=ttft_slo, tpot_slo=tpot_slo, e2e_slo=e2e_slo)
    summary.update(
        errors=sum(r.error is not None for r in results), num_requests=len(results),
        url=url, endpoint=endpoint, model=model,
        total_input_tokens=sum(r.prompt_len for r in results if r.error is None),
        slos={"ttft": ttft_slo, "tpot": tpot_slo, "e2e": e2e_slo},
        requests=[{"ttft": m.ttft, "tpot": m.tpot, "e2e": m.e2e, "itl": m.itl,
                   "prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
                   "finish_reason": r.finish_reason, "error": r.error}
                  for r, m in ((r, r.metrics()) for r in results)])
    return summary


def benchmark(url: str, specs: Sequence, **kwargs) -> dict:
    """Synchronous ``run_benchmark`` (for scripts; in Jupyter, ``await run_benchmark``)."""
    return asyncio.run(run_benchmark(url, specs, **kwargs))


def format_summary(s: dict) -> str:
    """A printed result table in the spirit of vLLM's ``benchmark_serving``."""
    def row(label, value, fmt="{:.2f}"):
        text = "nan" if isinstance(value, float) and math.isnan(value) else fmt.format(value)
        return f"{label:<40}{text:>12}"
    lines = ["{:=^52}".format(" Serving Benchmark Result "),
             row("Successful requests:", s["completed"], "{}"),
             row("Failed requests:", s["errors"], "{}"),
             row("Benchmark duration (s):", s["duration"]),
             row("Total input tokens:", s["total_input_tokens"], "{}"),
             row("Total generated tokens:", s["total_output_tokens"], "{}"),
             row("Request throughput (req/s):", s["request_throughput"]),
             row("Output token throughput (tok/s):", s["output_throughput"])]
    if "goodput" in s:
        lines += [row("Request goodput (req/s):", s["goodput"]),
                  row("SLO attainment:", s["slo_attainment"], "{:.3f}")]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2e", "End-to-end Latency")):
        lines.append("{:-^52}".format(f" {title} "))
        for stat in ("mean", "median", "p99"):
            lines.append(row(f"{stat.capitalize()} {key.upper()} (ms):", 1e3 * s[f"{stat}_{key}"]))
    lines.append("=" * 52)
    return "\n".join(lines)


def save_result(summary: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
