"""The router's counters, rendered in the Prometheus text format (version 0.0.4) at /metrics.

Single event loop, so plain ints suffice. Counters are per router process (Prometheus sums the
replicas); nothing here is shared through Redis.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Metrics:
    requests: Counter = field(default_factory=Counter)     # (api, outcome) -> n
    placements: Counter = field(default_factory=Counter)   # kept | new | moved
    tokens_generated: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    retries: int = 0          # attempts that failed before the turn's first token
    failovers: int = 0        # turns resumed on another verifier after tokens were streamed
    in_flight: int = 0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS_S) + 1))
    ttft_sum: float = 0.0
    ttft_count: int = 0

    def observe_ttft(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(TTFT_BUCKETS_S) if seconds <= b), len(TTFT_BUCKETS_S))
        self.ttft_buckets[i] += 1
        self.ttft_sum += seconds
        self.ttft_count += 1

    def render(self) -> str:
        lines = [
            "# HELP specmesh_router_requests_total Requests by API and outcome.",
            "# TYPE specmesh_router_requests_total counter",
        ]
        lines += [f'specmesh_router_requests_total{{api="{a}",outcome="{o}"}} {n}'
                  for (a, o), n in sorted(self.requests.items())]
        lines += ["# HELP specmesh_router_placements_total Placement decisions: binding kept, new, moved.",
                  "# TYPE specmesh_router_placements_total counter"]
        lines += [f'specmesh_router_placements_total{{decision="{d}"}} {n}' for d, n in sorted(self.placements.items())]
        for name, value, kind, text in (
            ("tokens_generated_total", self.tokens_generated, "counter", "Tokens streamed to clients."),
            ("prompt_tokens_total", self.prompt_tokens, "counter", "Prompt tokens of finished turns."),
            ("cached_prompt_tokens_total", self.cached_prompt_tokens, "counter",
             "Prompt tokens served from a verifier's KV cache."),
            ("retries_total", self.retries, "counter", "Attempts that failed before the first token."),
            ("failovers_total", self.failovers, "counter", "Turns resumed on another verifier mid-stream."),
            ("in_flight", self.in_flight, "gauge", "Turns in flight on this router."),
        ):
            lines += [f"# HELP specmesh_router_{name} {text}", f"# TYPE specmesh_router_{name} {kind}",
                      f"specmesh_router_{name} {value}"]
        lines += ["# HELP specmesh_router_ttft_seconds Time to first token.",
                  "# TYPE specmesh_router_ttft_seconds histogram"]
        acc = 0
        for b, n in zip((*map(str, TTFT_BUCKETS_S), "+Inf"), self.ttft_buckets, strict=True):
            acc += n
            lines.append(f'specmesh_router_ttft_seconds_bucket{{le="{b}"}} {acc}')
        lines += [f"specmesh_router_ttft_seconds_sum {self.ttft_sum}",
                  f"specmesh_router_ttft_seconds_count {self.ttft_count}"]
        return "\n".join(lines) + "\n"
