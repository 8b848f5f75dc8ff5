"""What a load test counts: per-request outcomes, latency samples with percentiles, and windows over time."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

PERCENTILES = (50, 90, 99)
"""Latency percentiles reported (linear interpolation between samples, NumPy's default)."""


def latency_summary(samples_s: Iterable[float]) -> dict[str, float | int]:
    """Count, mean, p50/p90/p99 and max of latency samples, in milliseconds.

    Args:
        samples_s: latencies, seconds.

    Returns:
        ``{"count", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"}``; the
        times are 0.0 when there are no samples.
    """
    array = np.fromiter(samples_s, dtype=np.float64)
    if not array.size:
        return {"count": 0, "mean_ms": 0.0, **{f"p{p}_ms": 0.0 for p in PERCENTILES}, "max_ms": 0.0}
    ms = array * 1e3
    points = np.percentile(ms, PERCENTILES)
    return {
        "count": int(array.size),
        "mean_ms": float(ms.mean()),
        **{f"p{p}_ms": float(v) for p, v in zip(PERCENTILES, points)},
        "max_ms": float(ms.max()),
    }


@dataclass(slots=True)
class Window:
    """Counts of the requests that completed within one window of wall time.

    Attributes:
        start_s: window start, seconds since the load test began.
        num_requests: requests completed.
        num_blocks: blocks they asked for.
        hit_blocks: prefix blocks they got from the store.
        input_tokens: their prompt tokens.
        hit_tokens: prompt tokens covered by hit blocks.
        bytes_read: encoded block bytes received by gets.
        bytes_written: encoded block bytes sent by puts.
    """

    start_s: float
    num_requests: int = 0
    num_blocks: int = 0
    hit_blocks: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def to_dict(self, window_s: float) -> dict[str, float | int]:
        """A JSON-ready dict with the window's ratios and rates (``window_s``: window length, seconds)."""
        return {
            "start_s": self.start_s,
            "end_s": self.start_s + window_s,
            "num_requests": self.num_requests,
            "num_blocks": self.num_blocks,
            "hit_blocks": self.hit_blocks,
            "hit_ratio": self.hit_blocks / self.num_blocks if self.num_blocks else 0.0,
            "token_hit_ratio": self.hit_tokens / self.input_tokens if self.input_tokens else 0.0,
            "requests_per_s": self.num_requests / window_s,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
        }


@dataclass(slots=True)
class RequestOutcome:
    """What one replayed request did.

    Attributes:
        index: position of the request in the trace (0-based, blank lines not counted).
        num_blocks: blocks the request asked for.
        hit_blocks: prefix blocks it got back from the store (the lookup's prefix,
            cut short if the get returned fewer).
        hit_tiers: tier name of each hit block, ``len == hit_blocks``.
        input_tokens: prompt tokens.
        hit_tokens: ``min(hit_blocks * block_tokens, input_tokens)``, as ``kvstore.tools.sim`` counts them.
        put_blocks: blocks sent by the put (all blocks after the hit prefix).
        stored_blocks: of those, how many the store newly stored.
        bytes_read: encoded bytes received by the get.
        bytes_written: encoded bytes sent by the put.
        mismatches: hit blocks whose bytes differ from the expected block.
        short_get: the get returned fewer blocks than the lookup found (eviction in between).
        lookup_s: latency of the lookup, seconds; ``None`` if it did not run.
        get_s: latency of the get; ``None`` if it did not run (no hit).
        put_s: latency of the put; ``None`` if it did not run (all hit).
        request_s: latency of the whole request.
        error: ``"<op>: <ErrorClass>"`` of the call that failed, or ``None``.
        error_message: that call's error text.
        finished_at_s: completion time, seconds since the load test began.
    """

    index: int
    num_blocks: int
    input_tokens: int
    hit_blocks: int = 0
    hit_tiers: tuple[str, ...] = ()
    hit_tokens: int = 0
    put_blocks: int = 0
    stored_blocks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    mismatches: int = 0
    short_get: bool = False
    lookup_s: float | None = None
    get_s: float | None = None
    put_s: float | None = None
    request_s: float = 0.0
    error: str | None = None
    error_message: str = ""
    finished_at_s: float = 0.0


@dataclass(slots=True)
class Recorder:
    """Aggregates :class:`RequestOutcome` s as they complete: totals, per-tier hits, latencies and windows.

    Failed requests (``error`` set) count in ``errors`` and nowhere else, so the hit
    ratios are over the requests that completed.

    Args:
        window_s: length of a time window, seconds.
    """

    window_s: float
    num_requests: int = 0
    num_blocks: int = 0
    hit_blocks: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    put_blocks: int = 0
    stored_blocks: int = 0
    get_blocks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    mismatches: int = 0
    short_gets: int = 0
    num_failed: int = 0
    hit_blocks_per_tier: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    error_samples: dict[str, str] = field(default_factory=dict)
    latencies_s: dict[str, list[float]] = field(
        default_factory=lambda: {"lookup": [], "get": [], "put": [], "request": []}
    )
    windows: dict[int, Window] = field(default_factory=dict)

    def add(self, outcome: RequestOutcome) -> None:
        """Count one finished request."""
        if outcome.error is not None:
            self.num_failed += 1
            self.errors[outcome.error] = self.errors.get(outcome.error, 0) + 1
            self.error_samples.setdefault(outcome.error, outcome.error_message)
        self.bytes_read += outcome.bytes_read
        self.bytes_written += outcome.bytes_written
        self.mismatches += outcome.mismatches
        for name, value in (("lookup", outcome.lookup_s), ("get", outcome.get_s), ("put", outcome.put_s)):
            if value is not None:
                self.latencies_s[name].append(value)
        slot = max(0, math.floor(outcome.finished_at_s / self.window_s))
        window = self.windows.get(slot)
        if window is None:
            window = self.windows[slot] = Window(slot * self.window_s)
        window.bytes_read += outcome.bytes_read
        window.bytes_written += outcome.bytes_written
        if outcome.error is not None:
            return
        self.latencies_s["request"].append(outcome.request_s)
        self.num_requests += 1
        self.num_blocks += outcome.num_blocks
        self.hit_blocks += outcome.hit_blocks
        self.input_tokens += outcome.input_tokens
        self.hit_tokens += outcome.hit_tokens
        self.put_blocks += outcome.put_blocks
        self.stored_blocks += outcome.stored_blocks
        self.get_blocks += outcome.hit_blocks
        self.short_gets += outcome.short_get
        for tier in outcome.hit_tiers:
            self.hit_blocks_per_tier[tier] = self.hit_blocks_per_tier.get(tier, 0) + 1
        window.num_requests += 1
        window.num_blocks += outcome.num_blocks
        window.hit_blocks += outcome.hit_blocks
        window.input_tokens += outcome.input_tokens
        window.hit_tokens += outcome.hit_tokens

    @property
    def hit_ratio(self) -> float:
        """Hit blocks / requested blocks so far (0.0 before any block)."""
        return self.hit_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def num_errors(self) -> int:
        """Failed calls so far (one per failed request)."""
        return sum(self.errors.values())

    def window_list(self) -> list[dict[str, float | int]]:
        """Every window from the first to the last, empty ones included, as JSON-ready dicts."""
        if not self.windows:
            return []
        last = max(self.windows)
        return [self.windows.get(slot, Window(slot * self.window_s)).to_dict(self.window_s) for slot in range(last + 1)]
