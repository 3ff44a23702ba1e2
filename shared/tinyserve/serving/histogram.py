"""One Prometheus histogram as ``/metrics`` shows it: cumulative bucket counts and a sum.

A window's histogram is the difference of two scrapes' (``minus``); several series
add up (``plus``); quantiles interpolate inside a bucket as Prometheus'
``histogram_quantile`` does; and ``contradicts_buckets`` tells a sum that no placing
of the observations in their buckets could give (two processes mixed in one window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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

    def plus(self, other: "Histogram", name: str) -> "Histogram":
        if other.bounds != self.bounds:
            raise ValueError(f"{name}: series with different bucket bounds")
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.cumulative, other.cumulative)),
                         self.sum + other.sum)

    def minus(self, before: "Histogram", name: str) -> "Histogram":
        if before.bounds != self.bounds:
            raise ValueError(f"{name}: bucket bounds changed between the scrapes")
        cumulative = tuple(a - b for a, b in zip(self.cumulative, before.cumulative))
        if any(c < 0 for c in cumulative) or self.sum < before.sum - 1e-9 * abs(before.sum):
            raise ValueError(f"{name} went down between the scrapes: the server restarted; scrape again")
        return Histogram(self.bounds, cumulative, self.sum - before.sum)

    @property
    def counts(self) -> list:
        """Observations in each bucket (not cumulative)."""
        return [c - p for c, p in zip(self.cumulative, (0.0,) + self.cumulative[:-1])]

    def contradicts_buckets(self) -> bool:
        """Is the sum outside what the buckets allow (every observation between its bucket's
        bounds)? A window whose before and after come from different processes can be."""
        if self.count <= 0:
            return False
        counts = self.counts
        lowers = (min(0.0, self.bounds[0]),) + self.bounds[:-1]
        low = sum(n * lo for n, lo in zip(counts, lowers) if n)
        high = sum(n * hi for n, hi in zip(counts, self.bounds) if n)
        slack = 1e-9 * max(abs(low), abs(self.sum), 1.0)
        return not low - slack <= self.sum <= high + slack

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
