"""The OpenAI-compatible server: a real process on a loopback port, plus in-process checks."""

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from tinyserve import LLM, SamplingParams
from tinyserve.bench.soak import hang_up_mid_stream
from tinyserve.serving.client import iter_sse
from tinyserve.serving.app import build_app
from tinyserve.serving.processes import ServerProcess
from tinyserve.serving.errors import BadRequest
from tinyserve.serving.request_parsing import parse_request, render_chat
from tinyserve.serving.scrape import parse_metrics

SERVE_ARGS = ["serve", "--model", "tiny", "--seed", "0", "--threads", "1", "--max-num-seqs", "32"]


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(SERVE_ARGS)
    try:
        yield proc.wait()
    finally:
        proc.stop()


async def _json(session, url):
    async with session.get(url) as r:
        assert r.status == 200
        return await r.json()


async def _wait_idle(session, url, timeout=30.0):
    """Poll /debug/engine until nothing is waiting or running (not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = await _json(session, url + "/debug/engine")
        if snap["num_running"] == 0 and snap["num_waiting"] == 0:
            return snap
        assert time.monotonic() < deadline, f"engine still busy: {snap}"
        await asyncio.sleep(0.05)


async def _stream(session, url, body):
    """POST a streaming request; return the parsed chunks (everything before [DONE])."""
    chunks, done = [], False
    async with session.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for data in iter_sse(r):
            if data == "[DONE]":
                done = True
                break
            chunks.append(json.loads(data))
    assert done, "stream ended without data: [DONE]"
    return chunks


def test_sse_framing_on_the_wire(server):
    """Raw HTTP/1.1 bytes: SSE events `data: {json}\\n\\n`, finish_reason last, then [DONE]."""
    async def main():
        reader, writer = await asyncio.open_connection(server.host, server.port)
        body = json.dumps({"prompt": [11, 12, 13], "max_tokens": 3, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        raw = await reader.read()
        writer.close()
        return raw

    raw = asyncio.run(main())
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"text/event-stream" in head and b"chunked" in head.lower()
    # De-chunk the HTTP/1.1 body.
    data, rest = b"", payload
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        data, rest = data + rest[:size], rest[size + 2:]
    events = data.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    parsed = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert all(e.startswith(b"data: ") for e in events[:-1])
    token_chunks, usage = parsed[:-1], parsed[-1]
    assert len(token_chunks) == 3
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None, None, "length"]
    assert all(c["object"] == "text_completion" and c["model"] == "tiny" for c in token_chunks)
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_200_concurrent_streams_no_errors_and_all_blocks_free(server):
    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            before = await _json(s, server.url + "/debug/engine")
            bodies = [{"prompt": [10 + i, 20 + i % 7, 30, 40 + i % 3], "max_tokens": 4,
                       "ignore_eos": True} for i in range(200)]
            results = await asyncio.gather(
                *[_stream(s, server.url + "/v1/completions", b) for b in bodies],
                return_exceptions=True)
            after = await _wait_idle(s, server.url)
            return before, results, after

    before, results, after = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == []
    for chunks in results:
        assert len(chunks) == 4
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert after["request_success_total"] - before["request_success_total"] == 200
    assert after["num_free_blocks"] == after["num_blocks"]
    assert after["integrity"] == "ok"


def test_mid_stream_disconnect_aborts_and_frees_blocks(server):
    async def main():
        async with aiohttp.ClientSession() as s:
            before = await _json(s, server.url + "/debug/engine")
            await hang_up_mid_stream(s, server.url, {"prompt": [10, 11, 12, 13, 14],
                                                     "max_tokens": 500, "ignore_eos": True})
            after = await _wait_idle(s, server.url)
            return before, after

    before, after = asyncio.run(main())
    assert after["request_abort_total"] - before["request_abort_total"] == 1
    assert after["request_success_total"] == before["request_success_total"]
    # 500 tokens were asked for; the abort stopped it long before that.
    assert after["num_steps"] - before["num_steps"] < 500
    assert after["num_free_blocks"] == after["num_blocks"]
    assert after["integrity"] == "ok"


def test_stream_equals_non_stream_equals_llm_generate(server):
    prompt = [100, 200, 300, 400, 500, 600, 700]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                full = await r.json()
            chunks = await _stream(s, server.url + "/v1/completions", body)
            async with s.post(server.url + "/v1/completions",
                              json={**body, "prompt": "你好，世界"}) as r:
                text_full = await r.json()
        return full, chunks, text_full

    full, chunks, text_full = asyncio.run(main())
    streamed_text = "".join(c["choices"][0]["text"] for c in chunks)
    streamed_ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert full["choices"][0]["text"] == streamed_text
    assert full["choices"][0]["token_ids"] == streamed_ids
    assert full["usage"] == {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19}
    # The same weights offline (preset "tiny", seed 0): the same greedy tokens and text.
    llm = LLM("tiny", seed=0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref, ref_text = llm.generate([prompt, "你好，世界"], params)
    assert streamed_ids == ref.token_ids
    assert streamed_text == ref.text
    assert text_full["choices"][0]["text"] == ref_text.text


def test_chat_stream_and_non_stream(server):
    body = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "你好"}],
            "max_tokens": 5, "temperature": 0, "ignore_eos": True}

    async def main():
        async with aiohttp.ClientSession() as s:
            chunks = await _stream(s, server.url + "/v1/chat/completions", body)
            async with s.post(server.url + "/v1/chat/completions", json=body) as r:
                return chunks, await r.json()

    chunks, full = asyncio.run(main())
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": text}
    ref = LLM("tiny", seed=0).generate(render_chat(body["messages"]),
                                       SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert text == ref.text


def test_metrics_health_models(server):
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/metrics") as r:
                assert r.headers["Content-Type"].startswith("text/plain")
                text = await r.text()
            return text, await _json(s, server.url + "/health"), await _json(s, server.url + "/v1/models")

    text, health, models = asyncio.run(main())
    names = ["num_requests_waiting", "num_requests_running", "kv_cache_usage_perc",
             "prefix_cache_hit_rate", "request_success_total", "prompt_tokens_total",
             "generation_tokens_total"]
    scrape = parse_metrics(text)
    for name in names:
        assert f"# HELP tinyserve:{name} " in text
        assert f"# TYPE tinyserve:{name} " in text
        assert scrape.series(f"tinyserve:{name}")
    assert 0 <= scrape.total("tinyserve:kv_cache_usage_perc") <= 1
    with pytest.raises(KeyError, match="has no tinyserve:no_such_metric"):
        scrape.total("tinyserve:no_such_metric")
    assert health == {"status": "ok"}
    assert models["data"][0]["id"] == "tiny"


def test_sigterm_stops_the_server_cleanly():
    proc = ServerProcess(SERVE_ARGS)
    try:
        proc.wait()
    finally:
        err = proc.stop()
    assert proc.process.returncode == 0, err


# ---- in-process: validation -----------------------------------------------------------

@pytest.fixture(scope="module")
def app_server():
    """An in-process aiohttp test server, on its own event loop (module-scoped)."""
    loop = asyncio.new_event_loop()
    engine = LLM("tiny", seed=0).engine
    srv = TestServer(build_app(engine, "tiny"))
    loop.run_until_complete(srv.start_server())
    try:
        yield loop, str(srv.make_url(""))
    finally:
        loop.run_until_complete(srv.close())
        loop.close()


BAD_BODIES = [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"max_tokens": 3}).encode(), "prompt"),
    (json.dumps({"prompt": ""}).encode(), "prompt"),
    (json.dumps({"prompt": [1, "a"]}).encode(), "prompt"),
    (json.dumps({"prompt": 5}).encode(), "prompt"),
    (json.dumps({"prompt": [1, 2, 99999]}).encode(), "prompt"),          # outside the vocab
    (json.dumps({"prompt": [5] * 600}).encode(), "prompt"),              # longer than 512
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": "8"}).encode(), "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": True}).encode(), "max_tokens"),
    (json.dumps({"prompt": "hi", "temperature": -1}).encode(), "temperature"),
    (json.dumps({"prompt": "hi", "top_p": 0}).encode(), "top_p"),
    (json.dumps({"prompt": "hi", "top_k": 0}).encode(), "top_k"),
    (json.dumps({"prompt": "hi", "stream": "yes"}).encode(), "stream"),
    (json.dumps({"prompt": "hi", "n": 99}).encode(), "n"),
    (json.dumps({"prompt": "hi", "stop_token_ids": ["x"]}).encode(), "stop_token_ids"),
    # Not JSON (no NaN or Infinity; deeper than the decoder goes): still named.
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "max_tokens": Infinity}', "max_tokens"),
    (b'{"max_tokens": 4, "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "prompt"),
    (json.dumps({"prompt": "hi", "max_tokens": 10**30}).encode(), "max_tokens"),   # > context
    (json.dumps({"prompt": [5] * 10, "max_tokens": 503}).encode(), "max_tokens"),  # 513 > 512
    (json.dumps({"prompt": "hi", "seed": "7"}).encode(), "seed"),
    (json.dumps({"prompt": "hi", "stop": [""]}).encode(), "stop"),
    (json.dumps({"prompt": "hi", "stop": ["a"] * 17}).encode(), "stop"),
    (json.dumps({"prompt": "hi", "logprobs": 21}).encode(), "logprobs"),
    (json.dumps({"prompt": "hi", "top_logprobs": 2}).encode(), "top_logprobs"),  # chat only
    # Parameters we do not implement: a 400 naming them, never a silent 200.
    (json.dumps({"prompt": "hi", "echo": True}).encode(), "echo"),
    (json.dumps({"prompt": "hi", "best_of": 2}).encode(), "best_of"),
    (json.dumps({"prompt": "hi", "suffix": "!"}).encode(), "suffix"),
    (json.dumps({"prompt": "hi", "frequency_penalty": 0.5}).encode(), "frequency_penalty"),
    (json.dumps({"prompt": "hi", "presence_penalty": -1}).encode(), "presence_penalty"),
    (json.dumps({"prompt": "hi", "logit_bias": {"5": 10}}).encode(), "logit_bias"),
    (json.dumps({"prompt": "hi", "tools": [{"type": "function",
                                            "function": {"name": "f"}}]}).encode(), "tools"),
    (json.dumps({"prompt": "hi", "response_format": {"type": "json_object"}}).encode(),
     "response_format"),
    (json.dumps({"prompt": "hi", "guided_json": {}}).encode(), "guided_json"),    # unknown
]

# Not implemented either, but at the value that means "off": served.
NEUTRAL_BODIES = [{"frequency_penalty": 0}, {"presence_penalty": 0.0}, {"echo": False},
                  {"best_of": 1}, {"logit_bias": {}}, {"tools": []}, {"user": "u1"},
                  {"response_format": {"type": "text"}}, {"tool_choice": "none"}]


def test_bad_bodies_get_400_and_the_server_keeps_serving(app_server):
    loop, url = app_server

    async def main():
        async with aiohttp.ClientSession() as s:
            for raw, param in BAD_BODIES:
                async with s.post(url + "/v1/completions", data=raw,
                                  headers={"Content-Type": "application/json"}) as r:
                    body = await r.json()
                    assert r.status == 400, (raw, body)
                    assert body["error"]["type"] == "invalid_request_error"
                    assert body["error"]["param"] == param, (raw, body)
                    assert body["error"]["message"]
            for extra in NEUTRAL_BODIES:
                async with s.post(url + "/v1/completions",
                                  json={"prompt": "hi", "max_tokens": 1, **extra}) as r:
                    assert r.status == 200, (extra, await r.text())
            async with s.post(url + "/v1/chat/completions", json={"messages": []}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "messages"
            for extra, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 3}, "logprobs"),
                                 ({"tools": [{"type": "function"}]}, "tools")):
                async with s.post(url + "/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": "hi"}],
                                        **extra}) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == param
            async with s.post(url + "/v1/completions", json={"prompt": "hi", "model": "gpt"}) as r:
                assert r.status == 404 and (await r.json())["error"]["param"] == "model"
            async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}) as r:
                assert r.status == 200
                return await r.json()

    ok = loop.run_until_complete(main())
    assert ok["usage"]["completion_tokens"] >= 1


def test_parse_request_errors_name_the_field():
    with pytest.raises(BadRequest, match="max_tokens must be an integer >= 1") as info:
        parse_request({"prompt": "x", "max_tokens": -2}, chat=False, model_name="m")
    assert info.value.param == "max_tokens"
    with pytest.raises(BadRequest, match=r"messages\[1\].role must be one of"):
        parse_request({"messages": [{"role": "user", "content": "a"}, {"role": "robot"}]},
                      chat=True, model_name="m")
    parsed = parse_request({"prompt": [[1, 2, 3]], "temperature": 0, "seed": 3}, False, "m")
    assert parsed.prompt == [1, 2, 3] and parsed.params.seed == 3 and parsed.params.greedy
    # Seeds of any size are reduced into torch's 64 bits; tiny temperatures are greedy.
    parsed = parse_request({"prompt": "x", "temperature": 1e-300, "seed": 2**64 + 3}, False, "m")
    assert parsed.params.seed == 3 and parsed.params.greedy
    with pytest.raises(BadRequest) as info:
        parse_request({"prompt": "x" * 101}, chat=False, model_name="m", max_prompt_chars=100)
    assert info.value.param == "prompt"
    with pytest.raises(BadRequest) as info:
        parse_request({"messages": [{"role": "user", "content": "x" * 101}]}, chat=True,
                      model_name="m", max_prompt_chars=100)
    assert info.value.param == "messages"


def test_render_chat_template():
    assert render_chat([{"role": "system", "content": "s"}, {"role": "user", "content": "你好"}]) \
        == "system: s\nuser: 你好\nassistant: "
