"""`tinyserve diagnose` on real traffic shapes (issue 28 §1).

Every scrape here is made the way the engine makes it (``traffic.Server``: the
engine's metric definitions in a ``prometheus_client`` registry, fed requests),
with a fake clock for the ``_created`` timestamps. Before each window the server
has served calm traffic.
"""

import gzip
import http.server
import re
import json
import math
import socketserver
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import prometheus_client
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

import metric_fixtures as mf
from tinyserve.cli import main
from tinyserve.serving import scrape
from tinyserve.serving.scrape import fetch_metrics, parse_metrics
from traffic import (CROSSOVER, LOAD_ENGINES, SGLANG_ABORTS, SOURCES, START, TPOT_SLO, TTFT_SLO,  # noqa: F401
                     VLLM_REUSE, Server, calm, clock, http_server, live)  # clock, http_server: fixtures


# ---- 1, 2: a queue that grows is overload, whatever the latency of what finished ------------

@pytest.mark.parametrize("engine", LOAD_ENGINES)
def test_an_overload_that_is_only_starting_is_overload(engine):
    server = Server(engine)
    calm(server)
    first = server.text()
    server.finish(300, seed=1)          # 5/s finish, while 13/s arrive: 480 of them wait
    server.levels(40, 480)
    d = live(first, server.text()).diagnosis
    assert d.stage == "overload", str(d)
    assert "arrive faster than they finish" in d.finding and d.action.startswith("add capacity")
    # The finished requests' latency holds: the queue is the evidence, and it is shown.
    assert d.evidence["p99_ttft (s) vs ttft_slo"][0] < TTFT_SLO
    assert d.evidence["queue_length_at_start"] == 0 and d.evidence["queue_length_at_end"] == 480
    assert d.evidence["arrival_rate"] == pytest.approx(13.0)
    assert d.evidence["request_throughput"] == pytest.approx(5.0)
    assert d.evidence["queue_growth_rate"] == pytest.approx(8.0)


@pytest.mark.parametrize("engine", LOAD_ENGINES)
def test_a_wedged_server_is_overload_and_says_nothing_finished(engine):
    server = Server(engine)
    calm(server)
    server.levels(40, 20)
    first = server.text()
    server.levels(40, 300)             # nothing finishes; the queue grows 20 -> 300
    d = live(first, server.text()).diagnosis
    assert d.stage == "overload", str(d)
    assert "nothing finished in the window" in d.finding and d.action.startswith("check the server")
    assert d.evidence["request_throughput"] == 0
    assert (d.evidence["queue_length_at_start"], d.evidence["queue_length_at_end"]) == (20, 300)


def test_a_steady_queue_is_not_a_backlog():
    server = Server("vllm")
    calm(server)
    server.levels(40, 30)
    first = server.text()
    server.finish(600, seed=2)
    server.levels(40, 30)
    assert live(first, server.text(), prefix_share=0.5).diagnosis.stage == "healthy"


# ---- 3: restarts, per engine, told by the engines' own timestamps -----------------------------

def test_a_restart_whose_new_counters_exceed_the_old_ones_counts_from_the_restart(clock):
    old = Server("vllm")
    calm(old)
    old.finish(700, seed=3)             # 1000 finished before the window
    first = old.text()
    clock[0] += 100
    new = Server("vllm")                # the server restarts: fresh series, later _created
    new.finish(1400, seed=4)
    new.levels(40, 0)
    result = live(first, new.text())
    assert result.summary["completed"] == 1400
    assert any("restarted in the window: engine 0" in note and "_created moved" in note for note in result.notes)
    assert "note: restarted in the window" in str(result)


def test_one_of_two_engines_restarting_is_counted_per_engine(clock):
    server = Server("vllm", engines=("0", "1"))
    server.finish(1000, "0", seed=5)
    server.finish(200, "1", seed=6)
    server.levels(40, 0, idx="0")
    server.levels(40, 0, idx="1")
    first = server.text()
    server.finish(400, "0", seed=7)
    clock[0] += 100
    server.restart("1")                 # engine 1 comes back and finishes 230
    server.finish(230, "1", seed=8)
    result = live(first, server.text())
    assert result.summary["completed"] == 630          # the summed counter says 430
    assert result.summary["mean_ttft"] > 0
    assert [n for n in result.notes if "engine 1" in n] and not [n for n in result.notes if "engine 0" in n]


def test_a_new_process_start_time_is_a_restart_of_the_whole_server(clock):
    old = Server("vllm", process_start=START)
    calm(old)
    first = old.text()
    clock[0] += 100
    new = Server("vllm", process_start=START + 100)
    new.finish(500, seed=9)
    new.levels(40, 0)
    result = live(first, new.text())
    assert result.summary["completed"] == 500
    assert any("the whole server" in n and "process_start_time_seconds" in n for n in result.notes)
    # The 40 the old process held were lost with it: arrivals are the 500 served and the 40 held now.
    assert result.summary["arrival_rate"] == pytest.approx((500 + 40) / 60)


def test_scrapes_in_the_wrong_order_are_named_by_their_timestamps(clock, tmp_path):
    old = Server("vllm")
    calm(old)
    (tmp_path / "a.prom").write_text(old.text())
    clock[0] += 100
    new = Server("vllm")
    new.finish(50)
    new.levels(40, 0)
    (tmp_path / "b.prom").write_text(new.text())
    with pytest.raises(ValueError, match=r"b\.prom was scraped after .*a\.prom: give the earlier scrape first"):
        from tinyserve.serving.live_diagnose import diagnose_files
        diagnose_files(tmp_path / "b.prom", tmp_path / "a.prom", 60, ttft_slo=TTFT_SLO, tpot_slo=TPOT_SLO)


def test_without_timestamps_counters_that_all_went_down_are_refused():
    server = Server("vllm")
    calm(server)
    first = server.text()
    server.finish(100)
    prometheus_client.disable_created_metrics()
    try:
        texts = server.text(), Server("vllm").text()
    finally:
        prometheus_client.enable_created_metrics()
    with pytest.raises(ValueError, match="restarted between the scrapes, or .* in the wrong order"):
        live(*texts)
    assert first


# ---- 4: one verdict on every engine ---------------------------------------------------------

def test_the_same_traffic_gets_the_same_verdict_on_every_engine():
    """Per-token gaps with a long tail: their p99 misses the TPOT SLO, the per-request
    TPOT (the mean of a request's gaps) does not."""
    verdicts = {}
    for engine in LOAD_ENGINES:
        server = Server(engine)
        calm(server)
        first = server.text()
        tpots, gaps = server.finish(600, seed=10, gap=(0.02, 0.6))
        server.levels(40, 0)
        result = live(first, server.text(), prefix_share=0.5)
        verdicts[engine] = result.diagnosis.stage
        assert np.quantile(gaps, 0.99) > TPOT_SLO > np.quantile(tpots, 0.99)
        if engine == "vllm":
            assert "p99_tpot (s) vs tpot_slo" in result.diagnosis.evidence
        else:                # mean with mean: the stand-in is the mean gap, never a p99 of gaps
            assert result.diagnosis.evidence["mean_tpot (s) vs tpot_slo (p99_tpot unknown)"][0] == \
                pytest.approx(gaps.mean())
            assert "p99_tpot" in result.unknown
    assert set(verdicts.values()) == {"healthy"}, verdicts


def test_below_the_crossover_is_said_only_when_the_crossover_is_known():
    server = Server("vllm")
    calm(server)
    first = server.text()
    server.finish(600, seed=11, gap=(0.07, 0.1))      # every step slow, no stalls, no queue
    server.levels(40, 0)
    second = server.text()
    known = live(first, second).diagnosis
    assert known.stage == "decode" and "below the crossover" in known.finding
    skipped = live(first, second, crossover=None).diagnosis
    assert skipped.stage == "decode" and "crossover" not in skipped.finding.split("without the crossover")[0]
    assert "below the crossover" not in skipped.finding and "--hardware" in skipped.action


# ---- 5: the model ---------------------------------------------------------------------------

def test_a_model_name_that_is_not_there_is_an_error_listing_the_names():
    server = Server("vllm")
    calm(server)
    text = server.text()
    with pytest.raises(ValueError, match=r"model 'meta-llama/Llama-3.1-8b' is not in after.prom; it has "
                                         r"meta-llama/Llama-3.1-8B-Instruct"):
        live(text, text, model="meta-llama/Llama-3.1-8b")


def test_a_model_that_changed_between_the_scrapes_is_an_error():
    one, two = Server("vllm"), Server("vllm", model="Qwen/Qwen2.5-7B-Instruct")
    calm(one)
    calm(two)
    with pytest.raises(ValueError, match=r"the model changed between the scrapes: before.prom has "
                                         r"meta-llama/Llama-3.1-8B-Instruct; after.prom has Qwen/Qwen2.5-7B"):
        live(one.text(), two.text())


# ---- 6: values no engine writes, and JSON ---------------------------------------------------

@pytest.mark.parametrize("sample, value", [
    ('vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0"', "+Inf"),
    ('vllm:num_requests_waiting{', "NaN"),
    ('vllm:prompt_tokens_total{', "-3.0"),
])
def test_nan_infinite_and_negative_values_are_refused_with_the_line(sample, value):
    server = Server("vllm")
    calm(server)
    text = server.text()
    lines = text.splitlines()
    line = next(n for n, s in enumerate(lines, 1) if s.startswith(sample))
    old = lines[line - 1]
    new = old.rsplit(" ", 1)[0] + " " + value
    value = re.escape(value)
    with pytest.raises(ValueError, match=rf"after.prom: line {line}: \S+ is {value}: .*finite numbers >= 0"):
        live(text, text.replace(old, new))


def test_json_is_always_valid(capsys, tmp_path):
    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")
    server = Server("sglang")
    calm(server)
    server.levels(40, 20)
    (tmp_path / "1.prom").write_text(server.text())
    server.levels(40, 300)
    (tmp_path / "2.prom").write_text(server.text())
    main(["diagnose", "--once", str(tmp_path / "1.prom"), str(tmp_path / "2.prom"), "--json"])
    out = json.loads(capsys.readouterr().out, parse_constant=no_constants)
    assert out["diagnosis"]["stage"] == "overload"
    result = live((tmp_path / "1.prom").read_text(), (tmp_path / "2.prom").read_text())
    result.summary["x"] = math.inf
    result.diagnosis.evidence["y"] = (-math.inf, math.nan)
    again = json.loads(result.to_json(), parse_constant=no_constants)
    assert again["summary"]["x"] is None and again["diagnosis"]["evidence"]["y"] == [None, None]


# ---- 7: reuse through a KV connector, and aborts --------------------------------------------

@pytest.mark.parametrize("exports", [("cached_prompt_tokens", "prompt_by_source", "external_queries", "external_hits"),
                                     ("prompt_by_source",), ("external_queries", "external_hits")])
def test_kv_connector_hits_count_as_reuse(exports):
    server = Server("vllm", extra={k: VLLM_REUSE[k] for k in exports})

    def prompts(n, local, external):
        for _ in range(n):
            prompt = 1000
            server.inc("prompt_tokens", prompt)
            server.inc("prefix_queries", prompt)
            server.inc("prefix_hits", local * prompt)
            server.inc("external_queries", prompt - local * prompt)
            server.inc("external_hits", external * prompt)
            server.inc("cached_prompt_tokens", (local + external) * prompt)
            for source, share in zip(SOURCES, (1 - local - external, local, external)):
                server.inc("prompt_by_source", share * prompt, source=source)
    server.finish(300, seed=12, prompts=False)
    prompts(300, 0.3, 0.0)
    server.levels(40, 0)
    first = server.text()
    server.finish(600, seed=13, prompts=False)
    prompts(600, 0.05, 0.62)                 # 5% found locally, 62% through the KV connector
    result = live(first, server.text(), prefix_share=0.7)
    assert result.summary["prefix_cache_hit_rate"] == pytest.approx(0.67)
    assert result.diagnosis.stage == "healthy", str(result)
    if "external_queries" in exports:
        assert result.summary["external_prefix_cache_hit_rate"] == pytest.approx(0.62 / 0.95)


def test_sglang_aborts_count_as_arrivals():
    server = Server("sglang", extra=SGLANG_ABORTS)
    calm(server)
    server.levels(40, 10)
    first = server.text()
    server.finish(600, seed=14)
    server.inc("aborted", 120)             # clients that hung up while their requests waited
    server.levels(40, 10)
    s = live(first, server.text()).summary
    assert s["arrival_rate"] == pytest.approx((600 + 120) / mf.WINDOW)
    assert s["request_throughput"] == pytest.approx(600 / mf.WINDOW)


# ---- 8: what is not a scrape, named by file and line -----------------------------------------

def good_scrapes(tmp_path):
    server = Server("vllm")
    calm(server)
    (tmp_path / "before.prom").write_text(server.text())
    server.finish(600, seed=15)
    (tmp_path / "after.prom").write_text(server.text())
    return server


def run_cli(tmp_path, capsys, *extra):
    with pytest.raises(SystemExit) as exc:
        main(["diagnose", "--once", str(tmp_path / "before.prom"), str(tmp_path / "after.prom"), *extra])
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (b"", r"after.prom: empty; expected the Prometheus text"),
    (gzip.compress(b"vllm:x 1\n", mtime=0), r"after.prom: gzip-compressed"),
    ("# HELP vllm:x caf\u00e9\nvllm:x 1\n".encode("latin-1"), r"after.prom: line 1, column 18: byte 0xe9 is not UTF-8"),
    (b"<html><head><title>502 Bad Gateway</title></head></html>\n", r"after.prom: an HTML page .*error page"),
    (b"# TYPE vllm:x gauge\nvllm:x 1\nthis is not a sample\n", r"after.prom: line 3: expected a sample"),
    (b"vllm:x{engine=\"0\" 1\n", r"after.prom: line 1: expected a sample"),
    (b"# TYPE vllm:x counter\nvllm:x_total 1\n# EOF\nvllm:y 2\n", r"after.prom: not valid|after.prom"),
])
def test_what_is_not_a_scrape_is_named_by_file_and_line(tmp_path, capsys, content, message):
    good_scrapes(tmp_path)
    (tmp_path / "after.prom").write_bytes(content)
    assert re.search(message, run_cli(tmp_path, capsys))


def test_an_openmetrics_scrape_is_read_like_the_text_one(tmp_path):
    server = good_scrapes(tmp_path)
    first = (tmp_path / "before.prom").read_text()
    text = live(first, server.text())
    om = generate_openmetrics(server.registry).decode()
    assert om.rstrip().endswith("# EOF") and "vllm_num_requests_running" in om     # escaped ':'
    opened = live(first, om)
    assert opened.summary == text.summary and opened.diagnosis.stage == text.diagnosis.stage
    with pytest.raises(ValueError, match="after.prom: not valid OpenMetrics"):
        live(first, om.replace("# EOF", "vllm_x_total{ 1\n# EOF").replace("vllm_x_total{ 1", "# TYPE x bogus"))


# ---- 9: size, time, and no torch ------------------------------------------------------------

def test_a_scrape_larger_than_the_limit_is_refused(tmp_path, capsys, monkeypatch):
    good_scrapes(tmp_path)
    monkeypatch.setattr(scrape, "MAX_SCRAPE_BYTES", 4096)
    assert (tmp_path / "after.prom").stat().st_size > 4096
    assert "MiB a scrape may be" in run_cli(tmp_path, capsys)


class Dribble(http.server.BaseHTTPRequestHandler):
    """Answers /metrics one byte every 0.2 s: in the headers (``/headers``) or the body."""
    def do_GET(self):
        try:
            if self.path.startswith("/headers"):
                for byte in b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n" * 1000:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.2)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            for byte in b"# HELP vllm:x x\n" * 1000:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass

    def log_message(self, *args):
        pass


class Big(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        try:
            self.wfile.write(b"vllm:x 1\n" * 1000)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("path", ["", "/headers"])
def test_the_timeout_bounds_the_whole_scrape(http_server, path):
    url = http_server(Dribble) + path
    began = time.monotonic()
    with pytest.raises(ConnectionError, match="no whole answer within --timeout 1 s"):
        fetch_metrics(url + "/metrics", timeout=1.0)
    assert time.monotonic() - began < 3.0          # loose: the bound is the whole GET, not each read


def test_a_fetched_scrape_larger_than_the_limit_is_refused(http_server, monkeypatch):
    monkeypatch.setattr(scrape, "MAX_SCRAPE_BYTES", 4096)
    with pytest.raises(ValueError, match="MiB a scrape may be"):
        fetch_metrics(http_server(Big), timeout=5)


def test_diagnose_imports_no_torch(tmp_path):
    good_scrapes(tmp_path)
    code = ("import sys; from tinyserve.cli import main; "
            f"main(['diagnose', '--once', {str(tmp_path / 'before.prom')!r}, {str(tmp_path / 'after.prom')!r}, "
            "'--json']); assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["engine"] == "vllm"
