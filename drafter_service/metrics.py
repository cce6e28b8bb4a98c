"""Prometheus metrics of a drafter service (`--metrics-port P`, 0 = off): trees drafted (tree size,
draft time per tree, predrafts included), draft sessions opened and closed, sessions held.

`MeteredDrafter` wraps any Drafter: its sessions time `draft` and count what they return, and
delegate everything else, so neither the servicer nor the drafters know they are measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from specmesh.costs import PERIOD_KINDS, Costs
from specmesh.drafters.base import Drafter, DraftSession
from specmesh.engine import STEP_ROWS  # the rows a verifier measures: the gauge's until one sent its points
from specmesh.metrics import Counter, Gauge, Histogram, Registry, start_exporter
from specmesh.planner import Acceptance
from specmesh.sampling import SamplingParams
from specmesh.tree import DraftTree

__all__ = ["DrafterMetrics", "MeteredDrafter", "start_exporter"]

PREFIX = "specmesh_drafter_"
DRAFT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
TREE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)


class DrafterMetrics:
    def __init__(self, sessions: Callable[[], int]) -> None:
        r = self.registry = Registry()
        self.trees = r.add(Counter(PREFIX + "trees_total", "Trees drafted (predrafts included)."))
        self.nodes = r.add(Counter(PREFIX + "tree_nodes_total", "Nodes of the trees drafted."))
        self.errors = r.add(Counter(PREFIX + "draft_errors_total", "draft calls that raised."))
        self.opened = r.add(Counter(PREFIX + "sessions_opened_total", "Draft sessions opened."))
        self.closed = r.add(Counter(PREFIX + "sessions_closed_total", "Draft sessions closed."))
        self.tree_size = r.add(Histogram(PREFIX + "tree_size", "Nodes per drafted tree.", TREE_BUCKETS))
        self.draft_time = r.add(Histogram(PREFIX + "draft_seconds", "Time to draft one tree (trees drafted together share the time).", DRAFT_BUCKETS_S))
        r.add(Gauge(PREFIX + "sessions", "Sessions held by the service.", sessions))

    def watch_planner(self, costs: Costs, recent: Acceptance) -> None:
        """Export what the planner weighs: the costs this process measured (the verifications, the
        link and step periods per verifier: `verifier` is the key it sent, "" for none) and the
        acceptance of its recent sessions (per depth and sibling rank, where tried)."""
        r = self.registry
        terms = {"level": 0, "row": 1, "fed": 2, "call": 3}
        r.add(Gauge(PREFIX + "draft_cost_seconds",
                    "Fitted draft call cost: seconds per level, per tree row, per committed token fed first, per call.",
                    lambda: {(call, k): fit.coef[i] for call, fit in (("draft", costs.draft), ("draft_many", costs.draft_many))
                             for k, i in terms.items()}, ("call", "term")))
        r.add(Gauge(PREFIX + "verify_cost_seconds",
                    "Predicted target verification step (alone or beside a predraft) by rows (pending token + "
                    "tree nodes), per verifier, at the row counts it measured, as live steps rescaled them.",
                    lambda: {(v, when, str(rows)): fit(1.0, rows) for v, c in costs.by_verifier()
                             for when, fit in (("alone", c.verify), ("overlapped", c.verify_overlapped))
                             for rows in [r for r, _ in c.verify_points] or STEP_ROWS}, ("verifier", "when", "rows")))
        r.add(Gauge(PREFIX + "link_seconds",
                    "Measured window from sending a tree to its commit, less the verification, per verifier.",
                    lambda: {(v,): c.link_s for v, c in costs.by_verifier()}, ("verifier",)))
        r.add(Gauge(PREFIX + "step_period_ratio",
                    "Measured step periods over the planner's predictions, per verifier and kind of plan: plain "
                    "runs, speculative steps, steps with drafting beside the verification (overlapped).",
                    lambda: {(v, kind): c.period_ratio(kind) for v, c in costs.by_verifier() for kind in PERIOD_KINDS},
                    ("verifier", "kind")))
        r.add(Gauge(PREFIX + "tokens_calibration",
                    "Recent sessions' trees: tokens accepted over what their acceptance rates expected (plans scale by it).",
                    lambda: recent.tokens_calibration))
        r.add(Gauge(PREFIX + "acceptance", "Recent sessions' acceptance given the parent accepted and elder siblings not.",
                    lambda: {(str(d + 1), str(k)): recent.rate(d + 1, k) for d in range(len(recent.tried))
                             for k in range(len(recent.tried[d])) if recent.tried[d][k] > 0}, ("depth", "rank")))

    def render(self) -> str:
        return self.registry.render()


class _MeteredSession:
    def __init__(self, inner: DraftSession, metrics: DrafterMetrics) -> None:
        self.inner, self.metrics = inner, metrics
        self._closed = False

    def draft(self, budget: int, depth: int, params: SamplingParams, generator: torch.Generator,
              exclude_root: Sequence[int] = (), branches: int = 0, guide=None) -> DraftTree:
        return self._metered(lambda: [self.inner.draft(budget, depth, params, generator, exclude_root, branches,
                                                        guide)])[0]

    @property
    def draft_many(self):
        """The drafter's own `draft_many`, metered; an AttributeError where it has none, so that
        `hasattr(session, "draft_many")` stays true to the drafter."""
        inner = self.inner.draft_many
        return lambda *args, **kwargs: self._metered(lambda: inner(*args, **kwargs))

    def _metered(self, draft: Callable[[], list[DraftTree]]) -> list[DraftTree]:
        """Count the trees of one draft call; trees drafted together share the call's time."""
        t = time.perf_counter()
        try:
            trees = draft()
        except Exception:
            self.metrics.errors.inc()
            raise
        each = (time.perf_counter() - t) / max(len(trees), 1)
        for tree in trees:
            self.metrics.draft_time.observe(each)
            self.metrics.trees.inc()
            self.metrics.nodes.inc(len(tree))
            self.metrics.tree_size.observe(len(tree))
        return trees

    def commit(self, tokens: list[int], features=None) -> None:
        self.inner.commit(tokens, features)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.metrics.closed.inc()
        self.inner.close()

    def __getattr__(self, name: str):  # anything else a drafter's session offers
        return getattr(self.inner, name)


class MeteredDrafter:
    def __init__(self, inner: Drafter, metrics: DrafterMetrics) -> None:
        self.inner, self.metrics = inner, metrics

    def open(self, context: list[int], features=None) -> _MeteredSession:
        session = _MeteredSession(self.inner.open(context, features), self.metrics)
        self.metrics.opened.inc()
        return session

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
