"""Metrics of a load test from per-request records: TTFT, TPOT, ITL, end-to-end latency (mean,
median, std, percentiles), request and token throughput, goodput under SLOs, speculation stats.

Field names follow vLLM's `benchmark_serving` (`mean_ttft_ms`, `p99_itl_ms`, `request_throughput`,
`output_throughput`, `request_goodput`, `completed`, `duration`, ...), so its tooling reads ours.
Definitions (vLLM's):
- TTFT: request sent -> first chunk carrying output.
- TPOT: (latency - TTFT) / (output tokens - 1), per request with more than one output token.
- ITL: gaps between consecutive chunks. A speculative step streams several tokens in one chunk,
  so ITL is per chunk, not per token (TPOT is per token); `mean_tokens_per_chunk` tells them apart.
- throughput: completed requests / output tokens over the run's `duration` (first send to last
  completion). In an A/B run both arms share one duration: an arm's throughput is its share.
- goodput: completed requests meeting every given SLO (TTFT, TPOT, E2EL), per second.
Pure functions on plain data: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_PERCENTILES = (90.0, 99.0)
SPEC_FIELDS = ("steps", "drafted_tokens", "accepted_tokens", "rejected_trees", "drafter_timeouts",
               "predraft_hits", "draft_s", "verify_s", "plain_steps")


@dataclass
class RequestRecord:
    """One request (one turn): what was sent, when chunks came back, what the server said."""
    arm: str                            # A/B arm ("spec" / "nospec")
    unit: int                           # workload unit (a prompt or a session) it belongs to
    turn: int = 0                       # round within a session
    prompt_len: int = 0                 # prompt tokens (the server's count when it gives one)
    start: float = 0.0                  # send time (monotonic seconds)
    chunk_times: list[float] = field(default_factory=list)   # arrival of each chunk with output
    chunk_tokens: list[int] = field(default_factory=list)    # tokens per chunk (0 when unknown)
    output_tokens: int = 0
    end: float = 0.0
    success: bool = False
    error: str = ""
    finish_reason: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    speculation: dict = field(default_factory=dict)          # the server's SpeculationStats

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None = not checked."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


def percentile_key(p: float) -> str:
    """90 -> 'p90', 99.9 -> 'p99.9' (vLLM's spelling)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def distribution(name: str, values_s: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict:
    """mean/median/std/percentiles of `values_s` (seconds) as `{stat}_{name}_ms`; 0 when empty (as vLLM)."""
    import numpy as np  # here: the CLI imports this module to build its flags

    ms = np.asarray(values_s, dtype=float) * 1000.0
    out = {f"mean_{name}_ms": float(ms.mean()) if ms.size else 0.0,
           f"median_{name}_ms": float(np.median(ms)) if ms.size else 0.0,
           f"std_{name}_ms": float(ms.std()) if ms.size else 0.0}
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return out


def meets_slo(r: RequestRecord, slo: Slo) -> bool:
    """A completed request within every objective (TPOT of a one-token request counts as 0)."""
    if not r.success:
        return False
    checks = ((slo.ttft_ms, r.ttft), (slo.tpot_ms, r.tpot or 0.0), (slo.e2el_ms, r.latency))
    return all(limit is None or (value is not None and value * 1000.0 <= limit) for limit, value in checks)


def speculation_totals(records: Sequence[RequestRecord]) -> dict:
    """Server-side speculation stats summed over completed requests, with the ratios recomputed
    from the sums (not averaged per request): acceptance rate = accepted / drafted, tokens per
    step = output tokens / verify steps (the mean accepted length + the bonus token)."""
    done = [r for r in records if r.success and r.speculation]
    tot = {k: sum(float(r.speculation.get(k, 0) or 0) for r in done) for k in SPEC_FIELDS}
    out_tokens = sum(r.output_tokens for r in done)
    steps = tot["steps"]
    return {
        "requests_with_stats": len(done),
        **{k: (round(v, 6) if k.endswith("_s") else int(v)) for k, v in tot.items()},
        "acceptance_rate": tot["accepted_tokens"] / tot["drafted_tokens"] if tot["drafted_tokens"] else 0.0,
        "tokens_per_step": out_tokens / steps if steps else 0.0,
        "mean_accepted_per_step": tot["accepted_tokens"] / steps if steps else 0.0,
        "predraft_hit_rate": tot["predraft_hits"] / steps if steps else 0.0,
    }


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo = Slo(),
              percentiles: Sequence[float] = DEFAULT_PERCENTILES, per_request: bool = True) -> dict:
    """vLLM-style result of one arm of one run. `duration_s` = the run's wall time."""
    ok = [r for r in records if r.success]
    duration = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    good = sum(meets_slo(r, slo) for r in ok) if slo.any else None
    res = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": None if good is None else good / duration,
        "good_requests": good,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
        "mean_tokens_per_chunk": out_tokens / chunks if chunks else 0.0,
        **distribution("ttft", [r.ttft for r in ok if r.ttft is not None], percentiles),
        **distribution("tpot", [t for r in ok if (t := r.tpot) is not None], percentiles),
        **distribution("itl", [g for r in ok for g in r.itls], percentiles),
        **distribution("e2el", [r.latency for r in ok], percentiles),
        "speculation": speculation_totals(ok),
    }
    if per_request:  # vLLM keeps these lists too (plots are drawn from them)
        res |= {"input_lens": [r.prompt_len for r in records], "output_lens": [r.output_tokens for r in records],
                "ttfts": [r.ttft if r.success else None for r in records],
                "tpots": [r.tpot for r in records], "e2els": [r.latency if r.success else None for r in records],
                "itls": [r.itls for r in records], "errors": [r.error for r in records]}
    return res


def ab_comparison(spec: dict, nospec: dict) -> dict:
    """How speculation changed the paired metrics: latency ratios nospec/spec (> 1 = faster with
    speculation), throughput ratio spec/nospec."""
    def ratio(a: float, b: float) -> float | None:
        return a / b if b and not math.isnan(b) and a else None

    return {
        "speedup_mean_tpot": ratio(nospec["mean_tpot_ms"], spec["mean_tpot_ms"]),
        "speedup_median_tpot": ratio(nospec["median_tpot_ms"], spec["median_tpot_ms"]),
        "speedup_mean_e2el": ratio(nospec["mean_e2el_ms"], spec["mean_e2el_ms"]),
        "speedup_mean_ttft": ratio(nospec["mean_ttft_ms"], spec["mean_ttft_ms"]),
        "output_throughput_ratio": ratio(spec["output_throughput"], nospec["output_throughput"]),
    }


def identical_outputs(records: Sequence[RequestRecord]) -> tuple[int, int]:
    """(pairs with identical token ids, pairs compared): the same prompt served by both arms.
    Greedy decoding is lossless, so every pair must match; with sampling this is not checked."""
    by_key: dict[tuple[int, int], dict[str, list[int]]] = {}
    for r in records:
        if r.success:
            by_key.setdefault((r.unit, r.turn), {})[r.arm] = r.token_ids
    pairs = [v for v in by_key.values() if len(v) == 2]
    same = sum(1 for v in pairs if len({tuple(t) for t in v.values()}) == 1)
    return same, len(pairs)
