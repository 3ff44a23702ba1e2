"""The server under faults and hostile input (issue 16): one bad request fails alone,
input work is bounded before tokenizing, parameters are applied or refused, errors are
OpenAI JSON, and a bounded load leaves nothing behind. Clients are the real ``openai``
SDK where what a client sees matters; all traffic stays on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import openai
import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import tinyserve.sampler
from tinyserve import LLM, SamplingParams
from tinyserve.bench.soak import check_soak, hang_up_mid_stream, soak_async, wait_idle
from tinyserve.sampler import sample_token
from tinyserve.serving.app import ENGINE_KEY, ServerConfig, build_app
from tinyserve.serving.processes import ServerProcess
from tinyserve.serving.request_parsing import render_chat
from tinyserve.serving.stops_and_logprobs import StopStrings
from tinyserve.tokenizer import CACHE_ENTRIES, load_default_tokenizer

from server_harness import Background

SERVE_ARGS = ["serve", "--model", "tiny", "--seed", "0", "--threads", "1", "--max-num-seqs", "32"]
FAIL_SEED = 666                  # the fault-injection test's marker

CONFIG = ServerConfig(header_timeout=1.0, body_timeout=1.0)


@pytest.fixture(scope="module")
def srv():
    engine = LLM("tiny", seed=0, max_num_seqs=16).engine
    bg = Background(build_app(engine, "tiny", CONFIG), **CONFIG.runner_kwargs())
    try:
        yield bg
    finally:
        bg.close()


@pytest.fixture(scope="module")
def ref():
    """The same weights offline: what every served answer must equal."""
    return LLM("tiny", seed=0)


def _get(url):
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.get(url) as r:
                return r.status, r.headers, await r.read()
    return asyncio.run(main())


def _debug(srv):
    async def main():
        async with aiohttp.ClientSession() as s:
            return await wait_idle(s, srv.url)
    return asyncio.run(main())


def _post(url, raw, headers=None):
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(url, data=raw,
                              headers=headers or {"Content-Type": "application/json"}) as r:
                return r.status, r.headers, await r.read()
    return asyncio.run(main())


def _metrics(srv) -> dict:
    status, _, body = _get(srv.url + "/metrics")
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def _counter(families, name) -> float:
    family = families[name.removesuffix("_total")]
    return next(s.value for s in family.samples if s.name == name)


# ---- isolation -----------------------------------------------------------------------

def test_tiny_temperature_is_greedy_and_huge_seeds_are_reduced(srv, ref):
    client = srv.sdk()
    prompt = [11, 12, 13, 14]
    greedy = ref.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1e-300,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == greedy.token_ids
    seeded = ref.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                                                   ignore_eos=True))[0]
    for seed in (2**64 + 5, 5):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0,
                                        seed=seed, extra_body={"ignore_eos": True,
                                                               "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == seeded.token_ids


def test_top_p_keeps_the_smallest_nucleus_and_never_less_than_the_top_token():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.1, 0.4, 0.2, 0.3]).log()
    # 0.5: the smallest set of most likely tokens reaching it is {0.4, 0.3}: both drawn.
    nucleus = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.5), gen)
               for _ in range(200)}
    assert nucleus == {1, 3}
    # However small top_p is (1e-300 is 0 in float32), the most likely token is kept.
    wide = torch.randn(2048, generator=gen) * 3
    for top_p in (1e-300, 1e-45, 1e-6):
        for temperature in (1.0, 2.0):
            params = SamplingParams(temperature=temperature, top_p=top_p)
            assert {sample_token(logits, params, gen) for _ in range(20)} == {1}
            assert sample_token(wide, params, gen) == int(wide.argmax())


def test_tiny_top_p_is_served_greedy(srv, ref):
    client = srv.sdk()
    prompt = [11, 12, 13, 14]
    greedy = ref.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0,
                                    top_p=1e-300, extra_body={"ignore_eos": True,
                                                              "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == greedy.token_ids
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, top_p=1e-300,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == greedy.text


def test_one_failing_request_fails_alone(srv, ref, monkeypatch):
    """Sampling is forced to raise for one seed: that request gets an error (event or
    500), every other request in the same batches gets exactly its offline tokens."""
    real = tinyserve.sampler.sample

    def faulty(logits, params, generators):
        if any(p.seed == FAIL_SEED for p in params):
            raise RuntimeError("injected sampling fault")
        return real(logits, params, generators)
    monkeypatch.setattr(tinyserve.sampler, "sample", faulty)

    before = _debug(srv)
    client = srv.sdk()
    bystanders = [([20 + i, 21, 22], dict(temperature=0.0) if i % 2 else
                   dict(temperature=0.9, seed=100 + i)) for i in range(6)]
    start = threading.Barrier(len(bystanders) + 2)

    def bystander(prompt, kw):
        start.wait()
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True},
                                           **kw)
        ids, finish = [], None
        for c in chunks:
            ids += c.choices[0].model_extra["token_ids"]
            finish = c.choices[0].finish_reason or finish
        return ids, finish

    def failing(stream):
        start.wait()
        time.sleep(0.05)            # join batches the bystanders are already in
        try:
            out = client.completions.create(model="tiny", prompt=[9, 9, 9], max_tokens=30,
                                            temperature=1.0, seed=FAIL_SEED, stream=stream)
            for _ in (out if stream else ()):
                pass
        except openai.APIError as exc:
            return exc
        return None

    with ThreadPoolExecutor(len(bystanders) + 2) as pool:
        jobs = [pool.submit(bystander, p, kw) for p, kw in bystanders]
        bad = [pool.submit(failing, True), pool.submit(failing, False)]
        results = [j.result(60) for j in jobs]
        errors = [b.result(60) for b in bad]
    streamed, whole = errors
    assert isinstance(streamed, openai.APIError) and "injected sampling fault" in streamed.message
    assert isinstance(whole, openai.InternalServerError) and "injected" in whole.message
    for (prompt, kw), (ids, finish) in zip(bystanders, results):
        want = ref.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True, **kw))[0]
        assert (ids, finish) == (want.token_ids, "length")
    after = _debug(srv)
    assert after["request_failure_total"] - before["request_failure_total"] == 2
    assert after["request_success_total"] - before["request_success_total"] == len(bystanders)
    assert after["num_free_blocks"] == after["num_blocks"] and after["integrity"] == "ok"
    assert _counter(_metrics(srv), "tinyserve:request_failure_total") >= 2


def test_offline_generate_still_raises_a_sampling_fault(monkeypatch):
    """Only a server opts in to per-request isolation: offline, a fault is never hidden
    behind placeholder tokens."""
    def broken(logits, params, generators):
        raise RuntimeError("injected")
    monkeypatch.setattr(tinyserve.sampler, "sample", broken)
    llm = LLM("tiny", seed=0)
    assert llm.engine.take_sample_failures() == {}
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=1.0))


def test_a_failed_step_fails_what_it_ran_and_the_engine_goes_on(srv, monkeypatch):
    engine = srv.app[ENGINE_KEY].engine
    real = engine.executor.execute
    calls = {"n": 0}

    def once(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step fault")
        return real(plan)
    monkeypatch.setattr(engine.executor, "execute", once)
    client = srv.sdk()
    with pytest.raises(openai.APIError, match="injected step fault"):
        for _ in client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=20,
                                           stream=True, extra_body={"ignore_eos": True}):
            pass
    out = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=5,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    snap = _debug(srv)
    assert snap["num_free_blocks"] == snap["num_blocks"] and snap["integrity"] == "ok"


# ---- bounded input work ----------------------------------------------------------------

def test_long_prompts_are_refused_untokenized_and_tokenizing_is_off_the_engine(srv, monkeypatch):
    engine = srv.app[ENGINE_KEY].engine
    seen = []
    real = engine.tokenizer.encode

    def spy(text, *args, **kwargs):
        seen.append((len(text), threading.current_thread().name))
        return real(text, *args, **kwargs)
    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    limit = engine.config.max_model_len * engine.tokenizer.max_token_chars
    for chat in (False, True):
        body = ({"messages": [{"role": "user", "content": "好" * (limit + 1)}]} if chat
                else {"prompt": "好" * (limit + 1)})
        status, _, raw = _post(srv.url + ("/v1/chat/completions" if chat else "/v1/completions"),
                               json.dumps(body).encode())
        param = json.loads(raw)["error"]["param"]
        assert status == 400 and param == ("messages" if chat else "prompt")
    assert seen == []                                   # never tokenized
    # 10 MB never even gets decoded: the body limit follows from the context.
    status, _, raw = _post(srv.url + "/v1/completions",
                           json.dumps({"prompt": " " * 10_000_000}).encode())
    assert status == 413 and json.loads(raw)["error"]["code"] == 413
    # A prompt that may fit is tokenized, on the tokenizer thread.
    status, _, _ = _post(srv.url + "/v1/completions",
                         json.dumps({"prompt": "你好", "max_tokens": 2}).encode())
    assert status == 200
    assert seen and all(name.startswith("tinyserve-tokenize") for _, name in seen)


def test_tokenizer_work_per_chunk_and_its_cache_are_capped():
    tok = load_default_tokenizer()
    tok.clear_cache()
    for n in (100, 1000, 5000):                   # pieces give the same ids here (no
        text = " " * n                            # whitespace merges in the vocabulary)
        assert tok.encode(text) == list(tok._bpe_chunk(text))
    tok.encode(" " * 2_000_000 + "x")
    info = tok._encode_chunk.cache_info()
    assert info.maxsize == CACHE_ENTRIES and info.currsize <= 2   # the long run is not cached
    text = "hello  world" + " " * 300 + "你好"
    assert tok.decode(tok.encode(text)) == text


def test_twenty_rejected_10mb_prompts_leave_rss_flat():
    with ServerProcess(SERVE_ARGS).wait() as server:
        proc = psutil.Process(server.process.pid)

        async def main():
            async with aiohttp.ClientSession() as s:
                async with s.post(server.url + "/v1/completions",
                                  json={"prompt": "hi", "max_tokens": 2}) as r:
                    assert r.status == 200
                start = proc.memory_info().rss
                for i in range(20):
                    body = json.dumps({"prompt": "\n" * (i % 3) + " " * (10_000_000 + i)}).encode()
                    async with s.post(server.url + "/v1/completions", data=body,
                                      headers={"Content-Type": "application/json"}) as r:
                        assert r.status in (400, 413), r.status
                        assert "error" in await r.json()
                return (proc.memory_info().rss - start) / 2**20
        growth = asyncio.run(main())
    assert growth < 50, f"RSS grew {growth:.0f} MB over 20 rejected 10 MB prompts"


# ---- parameters ----------------------------------------------------------------------

def test_stop_strings_hold_back_every_possible_prefix():
    text = "abcabd the stop is here: STOP, then more STO"
    for stops in (["STOP"], ["abd"], ["xyz"], ["here", "is h"], ["O, t"], ["ST", "STOP"]):
        hits = [text.find(s) for s in stops if s in text]
        want = text[:min(hits)] if hits else text
        for size in range(1, 9):                        # every piece size
            stop, out, stopped = StopStrings(stops), "", False
            for i in range(0, len(text), size):
                piece, stopped = stop.push(text[i:i + size])
                out += piece
                # Nothing sent is ever part of a stop string.
                assert want.startswith(out), (stops, size, out)
                if stopped:
                    break
            if not stopped:
                out += stop.flush()
            assert out == want and stopped == bool(hits), (stops, size)


def test_stop_strings_streamed_and_whole_with_the_sdk(srv, ref):
    client = srv.sdk()
    prompt = "你好，世界"
    full = ref.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0].text
    stop = full[8:10]
    want = full[:full.find(stop)]
    kw = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "never-seen"],
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(stop not in c.choices[0].text for c in chunks)
    messages = [{"role": "user", "content": "你好"}]
    chat_full = ref.generate(render_chat(messages),
                             SamplingParams(max_tokens=24, ignore_eos=True))[0].text
    chat_stop = chat_full[6:8]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                          temperature=0, stop=chat_stop,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == chat_full[:chat_full.find(chat_stop)]
    assert chat.choices[0].finish_reason == "stop"
    snap = _debug(srv)                                  # the stopped requests freed their blocks
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_logprobs_for_completions_and_chat(srv, ref):
    client = srv.sdk()
    prompt = [30, 31, 32, 33]
    offline = ref.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))[0]
    want = [lp for lp, _ in offline.request.logprobs]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                      logprobs=3, extra_body={"ignore_eos": True})
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy
        assert all(v <= 0 for v in top.values())
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=0, stream=True,
        extra_body={"ignore_eos": True})]
    assert [x for part in streamed for x in part.token_logprobs] == pytest.approx(want, abs=1e-4)
    assert all(top == {} for part in streamed for top in part.top_logprobs)
    hi = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=hi, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)      # greedy
        try:
            assert bytes(item.bytes).decode("utf-8") == item.token
        except UnicodeDecodeError:       # part of a character: the bytes, spelled out
            assert item.token == "bytes:" + "".join(f"\\x{b:02x}" for b in item.bytes)
    plain = client.chat.completions.create(model="tiny", messages=hi, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_n_choices_are_n_seeded_samples(srv, ref):
    client = srv.sdk()
    prompt = [40, 41, 42]
    wants = [ref.generate([prompt], SamplingParams(max_tokens=8, temperature=0.8, seed=7 + i,
                                                    ignore_eos=True))[0].text for i in range(3)]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.8,
                                      seed=7, n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == wants
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens == 3
    texts = ["", "", ""]
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                           temperature=0.8, seed=7, n=3, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == wants


# ---- errors and limits -----------------------------------------------------------------

def test_every_error_body_is_openai_json(srv):
    cases = [(_get(srv.url + "/nope"), 404), (_get(srv.url + "/v1/completions"), 405),
             (_post(srv.url + "/v1/completions", b"[" * 100_000 + b"]" * 100_000), 400),
             (_post(srv.url + "/v1/completions", b'{"a":' * 50_000 + b"1" + b"}" * 50_000), 400),
             (_post(srv.url + "/v1/completions", b"{" + b" " * (20 * 2**20) + b"}"), 413)]
    for (status, headers, raw), want in cases:
        assert status == want
        assert headers["Content-Type"].startswith("application/json")
        error = json.loads(raw)["error"]
        assert error["code"] == want and error["message"] and error["type"]
    assert "POST" in cases[1][0][1]["Allow"]


def test_max_tokens_beyond_the_context_is_rejected_and_the_default_is_cut(srv):
    client = srv.sdk()
    for max_tokens in (10**30, 600):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=[5] * 10, max_tokens=max_tokens)
        assert info.value.body["param"] == "max_tokens"
        assert "maximum context length is 512" in info.value.message
    # No max_tokens: the default (16) is cut to what fits after a 500-token prompt.
    out = client.completions.create(model="tiny", prompt=[5] * 500, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"


def test_chat_errors_name_max_completion_tokens_when_that_was_sent(srv):
    client = srv.sdk()
    messages = [{"role": "user", "content": "hi"}]
    for value, says in ((0, "max_completion_tokens must be an integer >= 1"),
                        (600, "maximum context length is 512")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=messages,
                                           max_completion_tokens=value)
        assert info.value.body["param"] == "max_completion_tokens"
        assert says in info.value.message and "(max_tokens)" not in info.value.message
    with pytest.raises(openai.BadRequestError) as info:         # the older name: as sent
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_bodies_that_are_not_json_name_the_field_at_fault(srv):
    """NaN and Infinity parse in Python but are not JSON; 5,000 nested lists overflow the
    decoder's recursion. Each is a 400 naming the top-level field (the SDK cannot send
    these, hence raw bodies)."""
    deep = b"[" * 5000 + b"]" * 5000
    cases = [("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
             ("/v1/completions", b'{"prompt": "hi", "max_tokens": -Infinity}', "max_tokens"),
             ("/v1/completions", b'{"prompt": ' + deep + b', "max_tokens": 2}', "prompt"),
             ("/v1/chat/completions", b'{"model": "tiny", "messages": ' + deep + b"}",
              "messages"),
             ("/v1/completions", b"{oops", None),                # no field to blame
             ("/v1/completions", deep, None)]
    for path, raw, param in cases:
        status, _, body = _post(srv.url + path, raw)
        error = json.loads(body)["error"]
        assert (status, error["code"], error["param"]) == (400, 400, param), (raw[:60], error)
        assert error["type"] == "invalid_request_error"
        assert param is None or f"(in {param})" in error["message"]


def test_header_and_body_read_timeouts():
    async def main(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")    # never finishes
        await writer.drain()
        t0 = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 10) == b""          # closed on us
        header_wait = time.monotonic() - t0
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")       # body stops short
        await writer.drain()
        t0 = time.monotonic()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        body_wait = time.monotonic() - t0
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        raw = head + await reader.readexactly(length)
        writer.close()
        return header_wait, raw, body_wait

    config = ServerConfig(header_timeout=0.5, body_timeout=0.5)
    engine = LLM("tiny", seed=0).engine
    bg = Background(build_app(engine, "tiny", config), **config.runner_kwargs())
    try:
        header_wait, raw, body_wait = asyncio.run(main(bg.port))
    finally:
        bg.close()
    assert header_wait < 3
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and body_wait < 3
    assert b"Connection: close" in head
    assert json.loads(body)["error"]["code"] == 408


def test_a_client_disconnect_logs_one_line(srv, caplog):
    async def main():
        async with aiohttp.ClientSession() as s:
            await hang_up_mid_stream(s, srv.url, {"prompt": [1, 2, 3], "max_tokens": 300,
                                                  "ignore_eos": True})
            return await wait_idle(s, srv.url)

    with caplog.at_level(logging.INFO):
        snap = asyncio.run(main())
        time.sleep(0.2)
    lines = [r for r in caplog.records if r.name.startswith(("tinyserve", "aiohttp"))]
    assert len(lines) == 1 and "client disconnected" in lines[0].getMessage(), \
        [r.getMessage() for r in lines]
    assert lines[0].exc_info is None
    assert snap["num_free_blocks"] == snap["num_blocks"]


# ---- observability ---------------------------------------------------------------------

LATENCIES = ("tinyserve:time_to_first_token_seconds", "tinyserve:time_per_output_token_seconds",
             "tinyserve:e2e_request_latency_seconds")
STEP_TOKENS = "tinyserve:iteration_tokens_total"


def test_metrics_histograms_and_fault_counters():
    # A cache of 12 blocks for 4 requests of up to 48 tokens: preemptions are certain.
    engine = LLM("tiny", seed=0, num_kv_blocks=12, block_size=4, max_num_seqs=4).engine
    bg = Background(build_app(engine, "tiny"))
    try:
        client = bg.sdk()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: client.completions.create(
                model="tiny", prompt=[50 + i] * 8, max_tokens=40, extra_body={"ignore_eos": True}),
                range(4)))
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="hi", presence_penalty=1.0)
        families = _metrics(bg)
    finally:
        bg.close()
    for name in LATENCIES + (STEP_TOKENS,):
        family = families[name]
        assert family.type == "histogram"
        buckets = [(s.labels["le"], s.value) for s in family.samples if s.name == name + "_bucket"]
        assert buckets[-1][0] == "+Inf"
        bounds = [float(le) for le, _ in buckets]
        counts = [v for _, v in buckets]
        assert bounds == sorted(bounds) and counts == sorted(counts)        # cumulative
        count = next(s.value for s in family.samples if s.name == name + "_count")
        total = next(s.value for s in family.samples if s.name == name + "_sum")
        assert counts[-1] == count and total > 0
        assert all(s.labels["model_name"] == "tiny" for s in family.samples)
        if name in LATENCIES:
            assert count == 4               # one per request
        else:                               # one per step, of the tokens it scheduled
            steps = list(engine.step_stats)
            assert count == len(steps) == engine.core.num_steps
            assert total == sum(st.num_scheduled_tokens for st in steps)
            for le, n in buckets:
                assert n == sum(st.num_scheduled_tokens <= float(le) for st in steps)
    assert _counter(families, "tinyserve:num_preemptions_total") > 0
    assert _counter(families, "tinyserve:request_rejected_total") == 1
    assert _counter(families, "tinyserve:request_failure_total") == 0
    assert _counter(families, "tinyserve:request_success_total") == 4     # unchanged names


# ---- a bounded load check on loopback ---------------------------------------------------

def test_bounded_load_rss_flat_and_blocks_free():
    """3 rounds of 200 concurrent streams with hostile requests mixed in (the full soak is
    ``python -m tinyserve.bench soak``): no errors, RSS flat from round 2 to 3, blocks free."""
    with ServerProcess(SERVE_ARGS).wait() as server:
        rows = asyncio.run(soak_async(server.url, server.process.pid, rounds=3, streams=200,
                                      max_tokens=8))
    assert check_soak(rows, max_growth_mb=5.0) == [], rows
    assert all(r["errors"] == 0 and r["hostile_failed"] == 0 for r in rows)
    assert not math.isnan(rows[-1]["rss_mb"])


def test_a_sigterm_to_the_owner_stops_the_server_it_started(tmp_path):
    # The server has a session of its own: the owner's SIGTERM must still end it (a vLLM
    # left behind holds gigabytes), through the context manager's exit.
    script = tmp_path / "owner.py"
    script.write_text(
        "import sys, time\n"
        "from tinyserve.serving.processes import ServerProcess\n"
        f"with ServerProcess({SERVE_ARGS!r}).wait() as server:\n"
        "    print(server.process.pid, flush=True)\n"
        "    time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    server_pid = None
    try:
        server_pid = int(owner.stdout.readline())
        assert psutil.pid_exists(server_pid)
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(60) == 128 + signal.SIGTERM
        assert not psutil.pid_exists(server_pid)
    finally:
        owner.kill()
        owner.wait()
        if server_pid is not None and psutil.pid_exists(server_pid):
            os.killpg(server_pid, signal.SIGKILL)       # what a failure left behind
