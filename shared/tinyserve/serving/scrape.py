"""Reading a server's Prometheus ``/metrics``: one scrape, and what changed between two.

    before = fetch_metrics("http://127.0.0.1:8000"); time.sleep(60)
    window = Window(before, fetch_metrics("http://127.0.0.1:8000"), seconds=60)
    window.delta("finished"), window.gauge("waiting"), window.histogram("ttft").quantile(0.99)

The text is parsed by ``prometheus_client``'s own parsers (Prometheus text
exposition, or OpenMetrics when it ends in ``# EOF``; OpenMetrics' ``vllm_``
spelling of ``vllm:`` is read as ``vllm:``). What is not a scrape is refused
with the file and the line: an empty file, gzip, bytes that are not UTF-8, an
HTML error page, a line that is not ``name{labels} value``, and an engine
sample whose value is NaN, infinite or negative (no count, level or time of an
engine is). A scrape is at most ``MAX_SCRAPE_BYTES``, and ``fetch_metrics``
gives up when the whole GET, not each read, takes longer than its timeout.

The engine (its dialect) is told by the metric prefix, and ``Window`` reads each
role of ``tinyserve.serving.dialects`` by the first of its names the server exports:

* a gauge is a level: its value at each scrape, summed over series (engines,
  ranks) or, for a fraction, averaged;
* a counter only grows: the window holds its increase, summed over series;
* a histogram's window is the difference of its cumulative buckets, and its
  quantiles interpolate inside a bucket as Prometheus' ``histogram_quantile``
  does (so they are only as fine as the bucket bounds).

A series absent from the first scrape counts from zero (labelled series appear
on first use). Restarts are found per engine (the ``engine``/rank labels): by
``process_start_time_seconds`` or a series' ``_created`` timestamp moving on, or
by a counter that went down. A restarted engine's series count from zero at the
restart, as Prometheus' ``increase()`` does, and ``Window.notes`` says so (what
it served between the first scrape and the restart is in no scrape). Timestamps
that go backwards mean the scrapes were given in the wrong order.
"""

from __future__ import annotations

import http.client
import math
import re
import socket
import threading
import time
import urllib.parse
import zlib
from dataclasses import dataclass, field

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from tinyserve.serving.dialects import DIALECTS, FRACTIONS, ROLES, SUMMED, Dialect, Name
from tinyserve.serving.histogram import Histogram

MODEL_LABEL = "model_name"
#: The largest scrape read (a real vLLM or SGLang /metrics is well under 1 MiB).
MAX_SCRAPE_BYTES = 16 * 2**20
#: Labels that tell one engine (process, data-parallel rank) of a server from another.
IDENTITY_LABELS = ("engine", "dp_rank", "tp_rank", "pp_rank")
#: Ranks of one model replica (tensor/pipeline parallel): they hold the same requests, so
#: one of them is read (the lowest), not their sum.
REPLICA_RANKS = ("tp_rank", "pp_rank", "moe_ep_rank")
#: Labels that tell data-parallel engines apart: each has its own batch.
ENGINE_LABELS = ("engine", "dp_rank")
PROCESS_START = "process_start_time_seconds"
PREFIXES = tuple(d.prefix for d in DIALECTS.values())
# One sample line: a name, optional {labels} (values may hold '}' inside quotes), a value.
SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?[ \t]+(\S+)(?:[ \t].*)?')
CLOCK_SLACK = 1e-3          # seconds: a timestamp printed twice may differ in its last digit


@dataclass
class Scrape:
    """One read of ``/metrics``: every sample name -> [(labels, value)] per series."""
    samples: dict
    source: str = "metrics"

    def series(self, name: str, model: str | None = None) -> list:
        return [(labels, value) for labels, value in self.samples.get(name, ())
                if model is None or labels.get(MODEL_LABEL, model) == model]

    def total(self, name: str) -> float:
        """The sum of ``name`` over its series (``KeyError`` if the scrape has none)."""
        if name not in self.samples:
            raise KeyError(f"{self.source} has no {name}")
        return sum(value for _, value in self.samples[name])

    def models(self) -> set:
        return {labels[MODEL_LABEL] for name, series in self.samples.items() if name.startswith(PREFIXES)
                for labels, _ in series if MODEL_LABEL in labels}


# ---- reading one scrape -----------------------------------------------------------

def check_size(num_bytes: int, source: str = "metrics") -> None:
    if num_bytes > MAX_SCRAPE_BYTES:
        raise ValueError(f"{source}: {num_bytes / 2**20:.1f} MiB is more than the {MAX_SCRAPE_BYTES // 2**20} MiB "
                         f"a scrape may be (a /metrics page is usually well under 1 MiB)")


def decode_scrape(data: bytes, source: str = "metrics") -> str:
    """The text of a saved or fetched scrape, or a ``ValueError`` saying what it is instead."""
    check_size(len(data), source)
    if data[:2] == b"\x1f\x8b":
        raise ValueError(f"{source}: gzip-compressed; expected the Prometheus text of /metrics "
                         f"(gunzip it first, or save it with curl --compressed)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(f"{source}: line {line}, column {column}: byte 0x{data[exc.start]:02x} is not UTF-8; "
                         f"Prometheus text is UTF-8 (was the file re-encoded, e.g. as Latin-1?)") from None


def check_lines(text: str, source: str) -> None:
    """Every line a comment, blank, or a sample; engine samples finite and >= 0."""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = SAMPLE.fullmatch(stripped)
        if match is None:
            raise ValueError(f"{source}: line {number}: expected a sample `name{{labels}} value`, "
                             f"got {stripped[:80]!r}")
        name, value = match.group(1), match.group(3)
        try:
            number_value = float(value)
        except ValueError:
            raise ValueError(f"{source}: line {number}: expected a sample `name{{labels}} value`; "
                             f"{name}'s value {value[:40]!r} is not a number") from None
        if engine_name(name).startswith(PREFIXES) and not (math.isfinite(number_value) and number_value >= 0):
            raise ValueError(f"{source}: line {number}: {name} is {value}: an engine's counts, levels and "
                             f"times are finite numbers >= 0")


def engine_name(name: str) -> str:
    """OpenMetrics (prometheus_client >= 0.22) escapes ``vllm:x`` as ``vllm_x``: read it back.
    A name (or sample line) whose name already holds a ':' was not escaped
    (``tinyserve_router:requests_routed_total`` stays as it is)."""
    if ":" in re.match(r"[^{\s]*", name).group():
        return name
    for prefix in PREFIXES:
        underscored = prefix[:-1] + "_"
        if name.startswith(underscored):
            return prefix + name[len(underscored):]
    return name


def unescape_samples(text: str) -> str:
    """prometheus_client >= 0.22 writes OpenMetrics families as ``# TYPE vllm:x`` but
    their samples as ``vllm_x``, which its own parser then splits into clashing
    families: give the samples back the family's spelling."""
    if not any(f"# TYPE {p}" in text for p in PREFIXES):
        return text
    return "\n".join(line if line.startswith("#") else engine_name(line) for line in text.split("\n"))


def parse_metrics(text: str, source: str = "metrics") -> Scrape:
    """A ``Scrape`` of Prometheus text exposition or OpenMetrics (``ValueError`` naming
    ``source`` and the line if it is neither)."""
    if not isinstance(text, str):
        raise ValueError(f"metrics text must be a str, got {type(text).__name__}")
    if len(text) > MAX_SCRAPE_BYTES:     # characters: a lower bound on the bytes
        check_size(len(text.encode("utf-8", "replace")), source)
    if not text.strip():
        raise ValueError(f"{source}: empty; expected the Prometheus text of a server's /metrics")
    first = text.lstrip()[:200]
    if first.startswith("<"):
        raise ValueError(f"{source}: an HTML page ({first.splitlines()[0][:60]!r}), not /metrics: the server "
                         f"or a proxy in front of it answered with an error page")
    check_lines(text, source)
    openmetrics = any(line.strip() == "# EOF" for line in text.splitlines()[-3:])
    if openmetrics:
        text = unescape_samples(text)
    samples: dict = {}
    try:
        families = openmetrics_families(text) if openmetrics else text_string_to_metric_families(text)
        for family in families:
            for s in family.samples:
                samples.setdefault(engine_name(s.name), []).append((dict(s.labels), float(s.value)))
    except (ValueError, IndexError, TypeError, KeyError) as exc:
        kind = "OpenMetrics (it ends in # EOF)" if openmetrics else "Prometheus text exposition"
        raise ValueError(f"{source}: not valid {kind}: {exc}") from None
    return Scrape(samples, source)


def metrics_url(url: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def fetch_metrics(url: str, timeout: float = 10.0) -> Scrape:
    """GET ``{url}/metrics`` and parse it; the whole GET (connect, headers, body) gets
    ``timeout`` seconds, and the body at most ``MAX_SCRAPE_BYTES``."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    target = metrics_url(url)
    parts = urllib.parse.urlsplit(target)
    deadline = time.monotonic() + timeout
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=timeout)
    # A server that sends a byte now and then never trips a per-read timeout: at the
    # deadline the socket is shut, which ends whatever read is under way.
    expired, opened = threading.Event(), []

    def expire() -> None:
        expired.set()
        for sock in opened:      # the connection's own socket: a response may outlive conn.sock
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        opened.append(conn.sock)
        if expired.is_set():
            expire()
        conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""),
                     headers={"Accept": "text/plain;version=0.0.4, */*;q=0.1", "Accept-Encoding": "identity"})
        response = conn.getresponse()
        if response.status != 200:
            raise ConnectionError(f"HTTP {response.status} {response.reason}")
        body = bytearray()
        while chunk := response.read1(65536):
            body += chunk
            check_size(len(body), target)
            if time.monotonic() > deadline:
                expire()
        if expired.is_set():
            raise TimeoutError
    except (http.client.HTTPException, OSError) as exc:     # OSError covers timeouts and ConnectionError
        why = f"no whole answer within --timeout {timeout:g} s" if expired.is_set() or isinstance(
            exc, TimeoutError) else exc
        raise ConnectionError(f"could not read {target}: {why}") from None
    finally:
        timer.cancel()
        conn.close()
    if "html" in (response.getheader("Content-Type") or ""):
        raise ValueError(f"{target}: the answer is an HTML page, not /metrics")
    if (response.getheader("Content-Encoding") or "").strip().lower() == "gzip":   # sent despite identity
        body = gunzip(bytes(body), target)
    return parse_metrics(decode_scrape(bytes(body), target), target)


def gunzip(data: bytes, source: str) -> bytes:
    """A gzip body, inflated to at most ``MAX_SCRAPE_BYTES``."""
    inflate = zlib.decompressobj(wbits=31)
    try:
        out = inflate.decompress(data, MAX_SCRAPE_BYTES + 1)
    except zlib.error as exc:
        raise ValueError(f"{source}: Content-Encoding gzip, but the body is not gzip ({exc})") from None
    check_size(len(out), source)
    return out


def read_scrape(path) -> Scrape:
    """A scrape saved to a file (``tinyserve diagnose --once``)."""
    from pathlib import Path
    path = Path(path)
    check_size(path.stat().st_size, str(path))
    return parse_metrics(decode_scrape(path.read_bytes(), str(path)), str(path))


def detect_dialect(scrape: Scrape) -> Dialect:
    found = [d for d in DIALECTS.values() if any(n.startswith(d.prefix) for n in scrape.samples)]
    if len(found) != 1:
        prefixes = ", ".join(d.prefix for d in DIALECTS.values())
        what = "none" if not found else ", ".join(d.prefix for d in found)
        raise ValueError(f"{scrape.source}: expected the metrics of exactly one engine ({prefixes}), found {what}")
    return found[0]


# ---- histograms ---------------------------------------------------------------------

def series_key(labels: dict, drop: str = "") -> frozenset:
    return frozenset((k, v) for k, v in labels.items() if k != drop)


def paired(before: list, after: list):
    """Each series of ``after`` as (labels, value, its value in ``before`` or None)."""
    old = {series_key(labels): value for labels, value in before}
    for labels, value in after:
        yield labels, value, old.get(series_key(labels))


def histograms_by_series(scrape: Scrape, name: str, model: str | None, ranks: dict | None = None) -> dict:
    """Series key (labels without ``le``) -> its ``Histogram``; ``ranks`` (label -> value)
    keeps one rank of each parallel group."""
    buckets: dict = {}
    for labels, value in scrape.series(name + "_bucket", model):
        if all(labels.get(label, v) == v for label, v in (ranks or {}).items()):
            buckets.setdefault(series_key(labels, "le"), {})[float(labels["le"])] = value
    sums = {series_key(labels): value for labels, value in scrape.series(name + "_sum", model)}
    out = {}
    for key, by_bound in buckets.items():
        bounds = tuple(sorted(by_bound))
        if bounds[-1] != math.inf:
            raise ValueError(f"{scrape.source}: {name}: histogram without a +Inf bucket")
        out[key] = Histogram(bounds, tuple(by_bound[b] for b in bounds), sums.get(key, 0.0))
    return out


# ---- two scrapes --------------------------------------------------------------------

def rank_order(value: str):
    return (0, int(value)) if value.isdigit() else (1, value)


def identity(labels) -> tuple:
    labels = dict(labels)
    return tuple((k, labels[k]) for k in IDENTITY_LABELS if k in labels)


def engine_text(ident: tuple) -> str:
    return "the whole server" if not ident else ", ".join(f"{k} {v}" for k, v in ident)


@dataclass
class Restarts:
    """Which engines of a server restarted between two scrapes, and how that was told."""
    engines: dict = field(default_factory=dict)     # identity -> how it was found
    timed: bool = False                              # process start or _created timestamps were there

    def covers(self, labels) -> bool:
        mine = set(identity(labels))
        return any(set(ident) <= mine for ident in self.engines)


def moment(was: float, now: float) -> str:
    """'A to B' with as many decimals as it takes for A and B to print differently."""
    for digits in (0, 1, 2, 3, 6):
        if f"{was:.{digits}f}" != f"{now:.{digits}f}":
            break
    return f"{was:.{digits}f} to {now:.{digits}f}"


def cumulative(name: str) -> bool:
    return name.endswith(("_total", "_count", "_sum", "_bucket"))


def find_restarts(before: Scrape, after: Scrape) -> Restarts:
    """Restarts told by timestamps (``process_start_time_seconds``, ``*_created``), then by
    counters that went down; ``ValueError`` when the timestamps say the order is wrong."""
    found = Restarts()
    wrong_order = f"{before.source} was scraped after {after.source}: give the earlier scrape first"
    starts = [max(v for _, v in s.series(PROCESS_START)) if s.series(PROCESS_START) else None
              for s in (before, after)]
    if None not in starts:
        found.timed = True
        if starts[1] < starts[0] - CLOCK_SLACK:
            raise ValueError(f"{wrong_order} ({PROCESS_START} went back from {starts[0]:.0f} to {starts[1]:.0f})")
        if starts[1] > starts[0] + CLOCK_SLACK:
            found.engines[()] = f"{PROCESS_START} moved from {moment(starts[0], starts[1])}"
    for name, series in after.samples.items():
        if not (name.endswith("_created") and name.startswith(PREFIXES)):
            continue
        for labels, value, was in paired(before.samples.get(name, ()), series):
            if was is None:
                continue
            found.timed = True
            if value < was - CLOCK_SLACK:
                raise ValueError(f"{wrong_order} ({name} went back from {was:.0f} to {value:.0f})")
            if value > was + CLOCK_SLACK and not found.covers(labels):
                found.engines[identity(labels)] = f"{name} moved from {moment(was, value)}"
    went_down = {}
    for name, series in after.samples.items():
        if not (cumulative(name) and name.startswith(PREFIXES)):
            continue
        for labels, value, was in paired(before.samples.get(name, ()), series):
            if was is not None and value < was and not found.covers(labels):
                went_down.setdefault(identity(labels), f"{name} went down ({was:g} -> {value:g})")
    if went_down and not found.timed:
        engines = {identity(labels) for name, series in before.samples.items()
                   if cumulative(name) and name.startswith(PREFIXES) for labels, _ in series}
        if set(went_down) >= engines or () in went_down:      # everything went down: which way round?
            raise ValueError(f"{next(iter(went_down.values()))}: the server restarted between the scrapes, or "
                             f"{before.source} and {after.source} are in the wrong order (neither "
                             f"{PROCESS_START} nor *_created is there to tell); scrape again")
    found.engines.update(went_down)
    return found


class Window:
    """Two scrapes of one server, ``seconds`` apart, read role by role in its dialect.

    ``found[role]`` is the ``Name`` each read used; ``missing(role)`` says why a role
    could not be read; ``notes`` what the reader should know (restarts). ``model``
    picks one ``model_name`` when a server serves several.
    """

    def __init__(self, before: Scrape, after: Scrape, seconds: float, model: str | None = None):
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds > 0 \
                or seconds == math.inf:
            raise ValueError(f"seconds must be a positive finite number, got {seconds!r}")
        self.dialect, earlier = detect_dialect(after), detect_dialect(before).engine
        if earlier != self.dialect.engine:
            raise ValueError(f"the two scrapes come from different engines ({before.source}: "
                             f"{earlier}, {after.source}: {self.dialect.engine})")
        self.before, self.after, self.seconds = before, after, float(seconds)
        self.model = self.choose_model(model)
        self.restarts = find_restarts(before, after)
        self.notes = [f"restarted in the window: {engine_text(ident)} ({how}); its series count from zero "
                      f"at the restart, and what it served before that is in neither scrape"
                      for ident, how in self.restarts.engines.items()]
        self.found: dict = {}
        self.ranks = {label: min(values, key=rank_order) for label in REPLICA_RANKS
                      if len(values := {labels[label] for series in after.samples.values()
                                        for labels, _ in series if label in labels}) > 1}
        if self.ranks:
            read = ", ".join(f"{label} {value}" for label, value in self.ranks.items())
            self.notes.append(f"{self.dialect.engine} exports several {'/'.join(self.ranks)} series: read at {read} only "
                              f"(the ranks of one tensor/pipeline-parallel group hold the same requests)")
        self.identical = before.samples == after.samples
        self.suspect: list = []         # histograms whose window sum contradicts their buckets

    def series(self, scrape: Scrape, metric: str) -> list:
        """``scrape``'s series of ``metric`` for the chosen model, one rank per parallel group."""
        return [(labels, value) for labels, value in scrape.series(metric, self.model)
                if all(labels.get(label, value_) == value_ for label, value_ in self.ranks.items())]

    def engines(self, role: str) -> int:
        """How many data-parallel engines export ``role`` (1 without an ``engine``/``dp_rank`` label)."""
        names = self.exported(role)
        if not names:
            return 1
        return max(1, len({tuple(labels.get(k) for k in ENGINE_LABELS)
                           for labels, _ in self.series(self.after, names[0].metric)}))

    def choose_model(self, model: str | None) -> str | None:
        before, after = self.before.models(), self.after.models()
        if before and after and before != after:
            raise ValueError(f"the model changed between the scrapes: {self.before.source} has "
                             f"{', '.join(sorted(before))}; {self.after.source} has {', '.join(sorted(after))}")
        if model is not None:
            if after and model not in after:
                raise ValueError(f"model {model!r} is not in {self.after.source}; it has "
                                 f"{', '.join(sorted(after))} (--model takes the model_name label)")
            return model
        if len(after) > 1:
            raise ValueError(f"the server exports several models ({', '.join(sorted(after))}); "
                             f"choose one with --model")
        return next(iter(after), None)

    def exported(self, role: str) -> list:
        kind = ROLES[role][0]
        suffix = "_bucket" if kind == "histogram" else ""
        names = [n for n in self.dialect.candidates(role) if self.series(self.after, n.metric + suffix)]
        return names if role in SUMMED else names[:1]

    def missing(self, role: str) -> str:
        tried = " / ".join(n.metric for n in self.dialect.candidates(role))
        if not tried:
            return f"{self.dialect.engine} exports no {ROLES[role][1]}"
        return f"metric {tried} not exported"

    def level(self, series: list, role: str) -> float:
        """Summed over the series, or averaged for a fraction (NaN with no series left)."""
        values = [v for _, v in series]
        if role in FRACTIONS:
            return sum(values) / len(values) if values else math.nan
        return sum(values)

    def gauge(self, role: str, surviving: bool = False) -> tuple | None:
        """(value at the first scrape, value at the second), or None if not exported. An
        engine that restarted in the window counts at its second value in both (its first
        is the dead process's); ``surviving``: in the first, it does not count at all
        (its requests were lost with it)."""
        names = self.exported(role)
        if not names:
            return None
        self.found[role] = names[0]
        before, after = (self.series(scrape, names[0].metric) for scrape in (self.before, self.after))
        first = [(labels, v) for labels, v in before if not self.restarts.covers(labels)]
        if not surviving:
            first += [(labels, v) for labels, v in after if self.restarts.covers(labels)]
        level = self.level(after, role)
        return (self.level(first, role) if before else level), level     # a gauge new in the window: flat

    def delta(self, role: str, where=None) -> float | None:
        """A counter's increase over the window, or None if not exported; ``where``
        (labels -> bool) keeps some series only."""
        names = self.exported(role)
        if not names:
            return None
        total = 0.0
        for name in names:
            for labels, value, was in paired(self.series(self.before, name.metric),
                                             self.series(self.after, name.metric)):
                if where is not None and not where(labels):
                    continue
                restarted = self.restarts.covers(labels)
                total += value if restarted or was is None else value - was
        self.found[role] = names[0] if len(names) == 1 else Name(" + ".join(n.metric for n in names))
        return total

    def histogram(self, role: str) -> Histogram | None:
        """The observations made during the window, or None if not exported."""
        names = self.exported(role)
        if not names:
            return None
        name = names[0].metric
        self.found[role] = names[0]
        old = histograms_by_series(self.before, name, self.model, self.ranks)
        total = None
        for key, h in histograms_by_series(self.after, name, self.model, self.ranks).items():
            if key in old and not self.restarts.covers(dict(key)):
                h = h.minus(old[key], name)
            total = h if total is None else total.plus(h, name)
        return total
