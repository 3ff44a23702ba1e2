"""The benchmark client against an in-process server: counts, metric definitions, goodput."""

import asyncio
import json
import math

import pytest
from aiohttp.test_utils import TestServer

from tinyserve import LLM
from tinyserve.serving.client import format_summary, iter_sse, run_benchmark
from tinyserve.serving.app import build_app
from tinyserve.workload import RequestSpec, make_workload


@pytest.fixture(scope="module")
def engine():
    return LLM("tiny", seed=0, max_num_seqs=16).engine


def _with_server(engine, coro_fn):
    async def main():
        srv = TestServer(build_app(engine, "tiny"))
        await srv.start_server()
        try:
            return await coro_fn(str(srv.make_url("")).rstrip("/"))
        finally:
            await srv.close()
    return asyncio.run(main())


def test_benchmark_counts_and_metric_definitions(engine):
    specs = make_workload("mixed", num_requests=12, rate=200.0, seed=3, max_len=256,
                          length_scale=0.1)
    result = _with_server(engine, lambda url: run_benchmark(url, specs, progress=False))
    assert result["errors"] == 0 and result["completed"] == 12
    assert result["model"] == "tiny"                         # asked the server's /v1/models
    # ignore_eos: every request produced exactly the tokens it asked for.
    assert result["total_output_tokens"] == sum(s.output_len for s in specs)
    assert result["total_input_tokens"] == sum(s.prompt_len for s in specs)
    for spec, r in zip(specs, result["requests"]):
        assert r["output_tokens"] == spec.output_len
        assert r["finish_reason"] == "length"
        assert len(r["itl"]) == spec.output_len - 1          # one streamed chunk per token
        assert r["e2e"] >= r["ttft"] > 0
        if spec.output_len > 1:                              # vLLM's TPOT
            assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / (spec.output_len - 1))
            assert r["tpot"] == pytest.approx(sum(r["itl"]) / len(r["itl"]))
        else:
            assert r["tpot"] is None
    assert result["mean_ttft"] == pytest.approx(sum(r["ttft"] for r in result["requests"]) / 12)
    table = format_summary(result)
    assert "Successful requests:" in table and "Mean TTFT (ms):" in table


def test_goodput_counts_requests_meeting_every_slo(engine):
    specs = [RequestSpec(0.01 * i, 6, 4) for i in range(6)]

    async def both(url):
        loose = await run_benchmark(url, specs, progress=False, ttft_slo=1e6, tpot_slo=1e6)
        tight = await run_benchmark(url, specs, progress=False, ttft_slo=0.0)
        return loose, tight

    loose, tight = _with_server(engine, both)
    assert loose["goodput"] == pytest.approx(loose["request_throughput"])
    assert loose["slo_attainment"] == 1.0
    assert tight["goodput"] == 0.0 and tight["slo_attainment"] == 0.0
    assert "goodput" not in (_with_server(engine, lambda u: run_benchmark(u, specs[:1], progress=False)))


def test_rejected_requests_count_as_errors(engine):
    specs = [RequestSpec(0.0, 5, 3), RequestSpec(0.0, 600, 3)]   # 600 > the 512 context
    result = _with_server(engine, lambda url: run_benchmark(url, specs, progress=False))
    assert result["errors"] == 1 and result["completed"] == 1
    assert result["requests"][1]["error"].startswith("HTTP 400")


def test_chat_endpoint_and_explicit_prompts(engine):
    specs = [RequestSpec(0.0, 3, 5), RequestSpec(0.0, 3, 2)]

    async def go(url):
        return await run_benchmark(url, specs, prompts=["你好", "hello"], progress=False,
                                   endpoint="/v1/chat/completions", model="tiny")
    result = _with_server(engine, go)
    assert result["errors"] == 0
    assert [r["output_tokens"] for r in result["requests"]] == [5, 2]


def test_cli_bench_serve_writes_json(engine, tmp_path, capsys):
    from tinyserve.cli import main
    out = tmp_path / "result.json"

    async def go(url):
        args = ["bench", "serve", "--url", url, "--workload", "shared-prefix", "--rate", "100",
                "--num-requests", "6", "--max-len", "256", "--length-scale", "0.1",
                "--ttft-slo", "100", "--out", str(out), "--no-progress"]
        # The CLI runs its own event loop: give it a thread, keep serving on this one.
        await asyncio.get_running_loop().run_in_executor(None, main, args)
    _with_server(engine, go)
    saved = json.loads(out.read_text())
    assert saved["completed"] == 6 and saved["errors"] == 0
    assert not math.isnan(saved["goodput"])
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_iter_sse_reassembles_split_events():
    class FakeContent:
        def __init__(self, parts):
            self.parts = parts

        async def iter_any(self):
            for p in self.parts:
                yield p

    class FakeResponse:
        content = FakeContent([b"da", b'ta: {"a": 1}\n', b"\ndata: [DO", b"NE]\n\n"])

    async def collect():
        return [d async for d in iter_sse(FakeResponse())]
    assert asyncio.run(collect()) == ['{"a": 1}', "[DONE]"]


def test_run_benchmark_validates_arguments():
    with pytest.raises(ValueError, match="specs must not be empty"):
        asyncio.run(run_benchmark("http://127.0.0.1:1", []))
    with pytest.raises(ValueError, match="prompts: got 1 for 2 specs"):
        asyncio.run(run_benchmark("http://127.0.0.1:1", [RequestSpec(0, 2, 2)] * 2,
                                  prompts=[[1, 2]]))


def test_error_events_and_rejections_count_as_errors(engine):
    """A request the server refuses (an unsupported parameter: 400 naming it) is an error
    of the benchmark, never a completed request."""
    specs = [RequestSpec(0.0, 4, 3), RequestSpec(0.0, 4, 3)]
    result = _with_server(engine, lambda url: run_benchmark(
        url, specs, progress=False, extra_body={"frequency_penalty": 0.5}))
    assert result["errors"] == 2 and result["completed"] == 0
    assert all("frequency_penalty" in r["error"] for r in result["requests"])
