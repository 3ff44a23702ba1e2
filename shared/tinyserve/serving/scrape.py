"""Reading a server's Prometheus ``/metrics``: one scrape, and what changed between two.

    before = fetch_metrics("http://127.0.0.1:8000"); time.sleep(60)
    window = Window(before, fetch_metrics("http://127.0.0.1:8000"), seconds=60)
    window.delta("finished"), window.gauge("waiting"), window.histogram("ttft").quantile(0.99)

The text is parsed by ``prometheus_client``'s own parser. The engine (its
dialect) is told by the metric prefix, and ``Window`` reads each role of
``tinyserve.serving.dialects`` by the first of its names the server exports:

* a gauge is a level: its value at each scrape, summed over series (engines,
  ranks) or, for a fraction, averaged;
* a counter only grows: the window holds its increase, summed over series;
* a histogram's window is the difference of its cumulative buckets, and its
  quantiles interpolate inside a bucket as Prometheus' ``histogram_quantile``
  does (so they are only as fine as the bucket bounds).

A series absent from the first scrape counts from zero (labelled series appear
on first use); a counter that went down means the server restarted in between.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tinyserve.serving.dialects import DIALECTS, FRACTIONS, ROLES, SUMMED, Dialect, Name

MODEL_LABEL = "model_name"


@dataclass
class Scrape:
    """One read of ``/metrics``: every sample name -> [(labels, value)] per series."""
    samples: dict

    def series(self, name: str, model: str | None = None) -> list:
        return [(labels, value) for labels, value in self.samples.get(name, ())
                if model is None or labels.get(MODEL_LABEL, model) == model]


def parse_metrics(text: str) -> Scrape:
    """A ``Scrape`` of Prometheus text exposition (``ValueError`` if it is not)."""
    if not isinstance(text, str):
        raise ValueError(f"metrics text must be a str, got {type(text).__name__}")
    samples: dict = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, IndexError, TypeError) as exc:
        raise ValueError(f"not Prometheus text exposition: {exc}") from None
    return Scrape(samples)


def metrics_url(url: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def fetch_metrics(url: str, timeout: float = 10.0) -> Scrape:
    """GET ``{url}/metrics`` and parse it."""
    target = metrics_url(url)
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:
            text = response.read().decode("utf-8")
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectionError(f"could not read {target}: {exc}") from None
    return parse_metrics(text)


def detect_dialect(scrape: Scrape) -> Dialect:
    found = [d for d in DIALECTS.values() if any(n.startswith(d.prefix) for n in scrape.samples)]
    if len(found) != 1:
        prefixes = ", ".join(d.prefix for d in DIALECTS.values())
        what = "none" if not found else ", ".join(d.prefix for d in found)
        raise ValueError(f"metrics: expected the metrics of exactly one engine ({prefixes}), found {what}")
    return found[0]


# ---- histograms ---------------------------------------------------------------------

@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts (``le`` bounds ascending, the last ``inf``) and the sum."""
    bounds: tuple
    cumulative: tuple
    sum: float

    @property
    def count(self) -> float:
        return self.cumulative[-1]

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def minus(self, before: "Histogram", name: str) -> "Histogram":
        if before.bounds != self.bounds:
            raise ValueError(f"{name}: bucket bounds changed between the scrapes")
        cumulative = tuple(a - b for a, b in zip(self.cumulative, before.cumulative))
        if any(c < 0 for c in cumulative) or self.sum < before.sum - 1e-9 * abs(before.sum):
            raise ValueError(f"{name} went down between the scrapes: the server restarted; scrape again")
        return Histogram(self.bounds, cumulative, self.sum - before.sum)

    def quantile(self, q: float) -> float:
        """Prometheus' ``histogram_quantile``: linear inside the bucket that holds rank
        ``q * count``; in the ``+Inf`` bucket, the highest finite bound (a lower bound)."""
        if not 0 <= q <= 1:
            raise ValueError(f"q must be in [0, 1], got {q!r}")
        if self.count <= 0:
            return math.nan
        rank = q * self.count
        b = next((i for i, c in enumerate(self.cumulative[:-1]) if c >= rank), len(self.bounds) - 1)
        if b == len(self.bounds) - 1:
            return self.bounds[-2] if len(self.bounds) > 1 else math.nan
        if b == 0 and self.bounds[0] <= 0:
            return self.bounds[0]
        start = self.bounds[b - 1] if b > 0 else 0.0
        below = self.cumulative[b - 1] if b > 0 else 0.0
        inside = self.cumulative[b] - below
        return start + (self.bounds[b] - start) * ((rank - below) / inside if inside else 1.0)


def read_histogram(scrape: Scrape, name: str, model: str | None) -> Histogram | None:
    by_bound: dict = {}
    for labels, value in scrape.series(name + "_bucket", model):
        bound = float(labels["le"])
        by_bound[bound] = by_bound.get(bound, 0.0) + value
    if not by_bound:
        return None
    bounds = tuple(sorted(by_bound))
    if bounds[-1] != math.inf:
        raise ValueError(f"{name}: histogram without a +Inf bucket")
    total = sum(value for _, value in scrape.series(name + "_sum", model))
    return Histogram(bounds, tuple(by_bound[b] for b in bounds), total)


# ---- two scrapes --------------------------------------------------------------------

class Window:
    """Two scrapes of one server, ``seconds`` apart, read role by role in its dialect.

    ``found[role]`` is the ``Name`` each read used; ``missing(role)`` says why a role
    could not be read. ``model`` picks one ``model_name`` when a server serves several.
    """

    def __init__(self, before: Scrape, after: Scrape, seconds: float, model: str | None = None):
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds > 0 \
                or seconds == math.inf:
            raise ValueError(f"seconds must be a positive finite number, got {seconds!r}")
        self.dialect = detect_dialect(after)
        if detect_dialect(before).engine != self.dialect.engine:
            raise ValueError("the two scrapes come from different engines")
        self.before, self.after, self.seconds = before, after, float(seconds)
        self.model = model if model is not None else self.only_model()
        self.found: dict = {}

    def only_model(self) -> str | None:
        models = {labels[MODEL_LABEL] for name, series in self.after.samples.items()
                  if name.startswith(self.dialect.prefix)
                  for labels, _ in series if MODEL_LABEL in labels}
        if len(models) > 1:
            raise ValueError(f"the server exports several models ({', '.join(sorted(models))}); "
                             f"choose one with --model")
        return models.pop() if models else None

    def exported(self, role: str) -> list:
        kind = ROLES[role][0]
        suffix = "_bucket" if kind == "histogram" else ""
        names = [n for n in self.dialect.candidates(role) if self.after.series(n.metric + suffix, self.model)]
        return names if role in SUMMED else names[:1]

    def missing(self, role: str) -> str:
        tried = " / ".join(n.metric for n in self.dialect.candidates(role))
        if not tried:
            return f"{self.dialect.engine} exports no {ROLES[role][1]}"
        return f"metric {tried} not exported"

    def level(self, scrape: Scrape, role: str, name: Name) -> float | None:
        values = [v for _, v in scrape.series(name.metric, self.model)]
        if not values:
            return None
        return sum(values) / len(values) if role in FRACTIONS else sum(values)

    def gauge(self, role: str) -> tuple | None:
        """(value at the first scrape, value at the second), or None if not exported."""
        names = self.exported(role)
        if not names:
            return None
        self.found[role] = names[0]
        before, after = (self.level(s, role, names[0]) for s in (self.before, self.after))
        return (after if before is None else before), after

    def delta(self, role: str) -> float | None:
        """A counter's increase over the window, or None if not exported."""
        names = self.exported(role)
        if not names:
            return None
        total = 0.0
        for name in names:
            before = self.level(self.before, role, name) or 0.0
            after = self.level(self.after, role, name)
            if after < before:
                raise ValueError(f"{name.metric} went down ({before:g} -> {after:g}): the server "
                                 f"restarted between the scrapes; scrape again")
            total += after - before
        self.found[role] = names[0] if len(names) == 1 else Name(" + ".join(n.metric for n in names))
        return total

    def histogram(self, role: str) -> Histogram | None:
        """The observations made during the window, or None if not exported."""
        names = self.exported(role)
        if not names:
            return None
        name = names[0].metric
        after = read_histogram(self.after, name, self.model)
        before = read_histogram(self.before, name, self.model)
        self.found[role] = names[0]
        if before is None:
            return after
        return after.minus(before, name)
