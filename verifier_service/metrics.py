"""Prometheus metrics of a verifier (`--metrics-port P`, 0 = off): turns by finish reason, tokens,
speculation per verify step (accepted length, tree size, time waiting for the draft, verify time),
acceptance rate per turn, TTFT and TPOT, sessions held and turns in flight; with batched
verification (specmesh.batching), forwards run and mean sessions per forward.

`MeteredVerifier` is a Verifier whose `run` is observed from outside: each chunk of a turn is one
verify step's new tokens, and the turn's cumulative stats (`Outcome.result.stats`, updated in place
by the engine) are diffed at each chunk, so per-step values are exact without hooks in the engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass

from specmesh.metrics import Counter, Gauge, Histogram, Registry, start_exporter
from verifier_service.config import VerifierConfig
from verifier_service.turns import Chunk, Outcome, Turn, Verifier

__all__ = ["MeteredVerifier", "VerifierMetrics", "start_exporter"]

PREFIX = "specmesh_verifier_"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16)
TREE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass(frozen=True)
class _Snapshot:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0

    @staticmethod
    def of(out: Outcome) -> _Snapshot:
        s = out.result.stats
        return _Snapshot(s.steps, s.drafted_tokens, s.accepted_tokens, s.draft_s, s.verify_s)


class VerifierMetrics:
    def __init__(self, sessions: Callable[[], int]) -> None:
        r = self.registry = Registry()
        self._in_flight = 0
        self._lock = threading.Lock()
        self.turns = r.add(Counter(PREFIX + "turns_total", "Turns by finish reason.", ["finish"]))
        self.tokens = r.add(Counter(PREFIX + "tokens_generated_total", "Tokens streamed."))
        self.prompt = r.add(Counter(PREFIX + "prompt_tokens_total", "Prompt tokens of turns."))
        self.cached = r.add(Counter(PREFIX + "cached_prompt_tokens_total", "Prompt tokens served from the KV cache."))
        self.steps = r.add(Counter(PREFIX + "steps_total", "Verify steps."))
        self.drafted = r.add(Counter(PREFIX + "drafted_tokens_total", "Draft tokens verified."))
        self.accepted = r.add(Counter(PREFIX + "accepted_tokens_total", "Draft tokens accepted."))
        self.timeouts = r.add(Counter(PREFIX + "drafter_timeouts_total", "Steps verified without a tree (deadline)."))
        self.hits = r.add(Counter(PREFIX + "predraft_hits_total", "Trees ready when the commit arrived."))
        self.plain = r.add(Counter(PREFIX + "plain_steps_total",
                                   "One-row steps of plain runs (the drafter chose no tree; no round trip)."))
        self.accepted_len = r.add(Histogram(PREFIX + "accepted_length", "Draft tokens accepted per verify step.",
                                            ACCEPTED_BUCKETS))
        self.tree_size = r.add(Histogram(PREFIX + "tree_size", "Draft tree nodes per verify step.", TREE_BUCKETS))
        self.draft_wait = r.add(Histogram(PREFIX + "draft_wait_seconds", "Time a verify step waited for its tree.",
                                          LATENCY_BUCKETS_S))
        self.verify_time = r.add(Histogram(PREFIX + "verify_step_seconds", "Forward pass and commit of one step.",
                                           LATENCY_BUCKETS_S))
        self.rate = r.add(Histogram(PREFIX + "acceptance_rate", "Accepted / drafted per turn with speculation.",
                                    RATE_BUCKETS))
        self.ttft = r.add(Histogram(PREFIX + "ttft_seconds", "Turn start to first token.", LATENCY_BUCKETS_S))
        self.tpot = r.add(Histogram(PREFIX + "tpot_seconds", "Time per output token after the first.",
                                    LATENCY_BUCKETS_S))
        r.add(Gauge(PREFIX + "sessions", "Sessions whose KV cache is held.", sessions))
        r.add(Gauge(PREFIX + "turns_in_flight", "Turns running now (the queue of this verifier).",
                    lambda: self._in_flight))

    def render(self) -> str:
        return self.registry.render()

    def _observe_steps(self, before: _Snapshot, after: _Snapshot) -> None:
        d = _Snapshot(*(b - a for a, b in zip(astuple(before), astuple(after))))
        for _ in range(d.steps):  # normally one step per chunk; spread evenly otherwise
            self.accepted_len.observe(d.accepted / d.steps)
            self.tree_size.observe(d.drafted / d.steps)
            self.draft_wait.observe(d.draft_s / d.steps)
            self.verify_time.observe(d.verify_s / d.steps)

    def observe(self, chunks: Iterator[Chunk], out: Outcome) -> Iterator[Chunk]:
        """Pass the turn's chunks through, measuring them."""
        t0, first, last, n = time.perf_counter(), None, None, 0
        seen = _Snapshot()
        finish = "error"
        with self._lock:
            self._in_flight += 1
        try:
            for chunk in chunks:
                if chunk.token_ids:
                    last = time.perf_counter()
                    first = first or last
                    n += len(chunk.token_ids)
                    now = _Snapshot.of(out)
                    self._observe_steps(seen, now)
                    seen = now
                yield chunk
            finish = out.finish_reason
        except GeneratorExit:
            finish = "cancelled"
            raise
        finally:
            with self._lock:
                self._in_flight -= 1
            self._observe_steps(seen, _Snapshot.of(out))
            self._observe_turn(out, finish, t0, first, last, n)

    def _observe_turn(self, out: Outcome, finish: str, t0: float, first: float | None, last: float | None,
                      n: int) -> None:
        s = out.result.stats
        self.turns.inc(1, finish)
        self.tokens.inc(n)
        self.prompt.inc(out.prompt_tokens)
        self.cached.inc(out.cached_prompt_tokens)
        self.steps.inc(s.steps)
        self.drafted.inc(s.drafted_tokens)
        self.accepted.inc(s.accepted_tokens)
        self.timeouts.inc(out.timeouts)
        self.hits.inc(out.predraft_hits)
        self.plain.inc(out.plain_steps)
        if s.drafted_tokens:
            self.rate.observe(s.accepted_tokens / s.drafted_tokens)
        if first is not None:
            self.ttft.observe(first - t0)
            if n > 1 and last is not None:
                self.tpot.observe((last - first) / (n - 1))


class MeteredVerifier(Verifier):
    def __init__(self, cfg: VerifierConfig, model, tokenizer) -> None:
        super().__init__(cfg, model, tokenizer)
        self.metrics = VerifierMetrics(lambda: len(self.sessions))
        batching = getattr(model, "stats", None)  # specmesh.batching.BatchingTarget (CPU, the default)
        if batching is not None:
            r = self.metrics.registry
            r.add(Gauge(PREFIX + "batch_forwards", "Target forwards run by batched verification (since start).",
                        lambda: batching.forwards))
            r.add(Gauge(PREFIX + "batch_sessions_per_forward", "Mean sessions' requests per batched forward "
                        "(since start; > 1 when concurrent sessions share forwards).",
                        lambda: batching.segments / max(batching.forwards, 1)))

    def run(self, turn: Turn, is_active: Callable[[], bool], out: Outcome) -> Iterator[Chunk]:
        return self.metrics.observe(super().run(turn, is_active, out), out)
