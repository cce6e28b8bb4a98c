"""Costs measured on the machine at hand, for the planner (`specmesh.planner`): nothing assumes a
wider level or a bigger tree is free; the priors below only hold until the first measurements.
- `LinearCost`: seconds as a linear function of work. The drafter's cost of one draft call is
  `a * levels + b * rows + f * fed + c` (rows: the nodes fed over all its levels, so `b` is what
  width costs; fed: committed tokens the call feeds first, which need no scores, so `f` is far
  below `b`; `c`: the call itself). `RowCost`: the target's verification by rows (the pending
  token + the tree's nodes), the verifier's measured steps interpolated (no line: a CPU kernel's
  cost jumps where rows outgrow its tile). How the terms compare is calibrated where the work runs
  (the drafter times its own calls at its start, the verifier its own steps at its start and sends
  them with each session); live calls rescale it as they come.
- `StepTable`: a verifier's step by rows as it sends it to drafters, measured at its start and
  corrected by its own live steps.
- `Costs`: what one process has measured (its drafter's calls, the target's verifications, the
  link's share of a step, and each kind of plan's measured step periods against their predictions,
  PERIOD_KINDS), kept apart per verifier.
This module knows nothing of sessions, transport or models.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from statistics import median

PERIOD_PRIOR = 2.0  # steps that "the prediction was right" is worth in `Costs.period_ratio`
PERIOD_FORGET = 0.97  # each measured step period weighs this much less with every later one of its kind ...
CROSS_FORGET = 0.995  # ... and this much less with every later one of another kind
LINK_WINDOW = 15  # link samples the estimate is the median of
MAX_VERIFIERS = 64  # verifiers whose costs a drafter keeps apart (`Costs.of_verifier`; least recently opened out)
PLAIN, SPECULATIVE, OVERLAPPED = PERIOD_KINDS = ("plain", "speculative", "overlapped")


class LinearCost:
    """seconds ~ scale * (shape . features). The shape, how the terms compare, comes from a
    calibration that varies every term (`fit_shape`: the drafter's own calls at its start, the
    verifier's own steps at its start, sent with each session); until one has run it is the prior.
    Live calls move only the scale, one number, an exponentially weighted mean of log(measured /
    shape) that is identified whatever shapes the planner picks. (A fit of every term over live
    calls alone cannot tell a per-row cost from the base while the planner keeps picking one
    shape: one stuck on a slow first call kept choosing one-node trees for a whole prompt.)"""

    def __init__(self, prior: tuple[float, ...], forget: float = 0.9) -> None:
        self.prior = tuple(prior)
        self.shape = list(prior)
        self.forget = forget
        self.calibrated = False
        self._log_sum = 0.0  # decayed sums of log(measured / shape) and of weights
        self._weight = 0.0
        self.samples = 0

    @property
    def scale(self) -> float:
        # the calibration counts as one live call, forgotten as they are: the first calls refine
        # its scale, not replace it
        prior_weight = self.forget ** self.samples if self.calibrated else 0.0
        total = self._weight + prior_weight
        return math.exp(self._log_sum / total) if total > 0 else 1.0

    @property
    def coef(self) -> list[float]:
        k = self.scale
        return [k * c for c in self.shape]

    def fit_shape(self, samples: list[tuple[tuple[float, ...], float]]) -> None:
        """Take the shape from calibration samples (features, seconds): non-negative least squares
        (a term whose coefficient would be negative is left out and the rest refitted). The scale
        starts afresh at 1. Fewer samples than terms, or a singular set, leave the shape as is."""
        n = len(self.prior)
        good = [(f, y) for f, y in samples if y >= 0 and math.isfinite(y)]
        free = [i for i in range(n) if any(f[i] for f, _ in good)]  # a term never varied costs nothing seen
        while free and len(good) >= len(free):
            a = [[sum(f[i] * f[j] for f, _ in good) for j in free] for i in free]
            b = [sum(f[i] * y for f, y in good) for i in free]
            coef = _solve(a, b)
            if coef is None:
                return
            if min(coef) >= 0:
                shape = [0.0] * n
                for i, c in zip(free, coef):
                    shape[i] = c
                if sum(shape) <= 0:
                    return
                self.shape, self.calibrated = shape, True
                self._log_sum = self._weight = 0.0
                return
            free = [i for i, c in zip(free, coef) if c > 0]

    def guess(self, features: tuple[float, ...]) -> float:
        """The shape's seconds for `features`, before the live scale."""
        return sum(c * x for c, x in zip(self.shape, features))

    def add(self, features: tuple[float, ...], seconds: float) -> None:
        guess = self.guess(features)
        if not (seconds > 0 and math.isfinite(seconds)) or guess <= 0:
            return
        self._log_sum = self.forget * self._log_sum + math.log(seconds / guess)
        self._weight = self.forget * self._weight + 1.0
        self.samples += 1

    def __call__(self, *features: float) -> float:
        return self.scale * self.guess(features)


class RowCost(LinearCost):
    """A verification's seconds by rows, features (1, rows). Until calibrated, the prior line
    a + b * rows. Calibrated (`fit_shape` over the verifier's measured steps), the shape is the
    measured points themselves: linear between neighbouring row counts, and past the last one
    along the line through the first and the last. A CPU kernel's step is not a line in rows: a
    tile of activation rows reads each weight block once, and a row past the tile reads them
    again; a least-squares line through steps of 1-9 rows put 5 rows at 1.7x one row's cost where
    they measured 1.36x, and the planner drafted less than paid. Live steps move the scale only,
    as for `LinearCost`."""

    def __init__(self, prior: tuple[float, float], forget: float = 0.9) -> None:
        super().__init__(prior, forget)
        self.points: tuple[tuple[float, float], ...] = ()  # (rows, seconds), rows ascending

    def fit_shape(self, samples: list[tuple[tuple[float, ...], float]]) -> None:
        """Points from samples ((1, rows), seconds), the fastest where a row count repeats (noise
        only adds); fewer than two row counts fit the line as `LinearCost` does."""
        best: dict[float, float] = {}
        for f, y in samples:
            if y > 0 and math.isfinite(y):
                best[f[-1]] = min(y, best.get(f[-1], math.inf))
        if len(best) < 2:
            super().fit_shape(samples)
            return
        self.points = tuple(sorted(best.items()))
        self.calibrated = True
        self._log_sum = self._weight = 0.0

    def guess(self, features: tuple[float, ...]) -> float:
        if not self.points:
            return super().guess(features)
        rows, pts = features[-1], self.points
        (r0, s0), (r1, s1) = pts[0], pts[-1]
        if rows >= r1:  # past the last point: the mean slope over all of them, never falling
            return s1 + max(0.0, (s1 - s0) / (r1 - r0)) * (rows - r1)
        if rows <= r0:
            return s0
        for (ra, sa), (rb, sb) in zip(pts, pts[1:]):
            if rows <= rb:
                return sa + (sb - sa) * (rows - ra) / (rb - ra)
        return s1


class StepTable:
    """A verifier's step by rows as it sends it to drafters (`RowCost`'s points): measured at its
    start, then corrected by its own live steps. A start-up measurement can be far off (the drafter
    starting beside it on the same cores once made one row 20% cheaper than it ran, and speculation
    lost to plain steps for whole prompts), and a drafter's live steps rescale its points, not their
    shape. So a row count with at least `MIN_LIVE` recent steps is sent as their median (of the last
    `WINDOW`); a tree's row count (2 or more) not seen live as measured at start times the median
    live/start ratio of the trees' row counts seen, else of one row's. One row not seen live keeps
    its start value: one-row steps run back to back in plain runs, as measured at start, while a
    tree among them pays for the caches (live trees of the SmolLM2 pair ran 1.36x their start
    points, plain runs 1.0x), so the trees' ratio would price plain runs too high and keep a session
    speculating at a loss. Only the row counts measured at start are kept; the planner's probes keep
    visiting the shapes it does not choose, so a wrong point is corrected once tried."""

    WINDOW = 16
    MIN_LIVE = 3

    def __init__(self, points) -> None:
        self.start = {int(r): float(s) for r, s in points}
        self.live: dict[int, list[float]] = {r: [] for r in self.start}
        self.key = uuid.uuid4().hex  # names the verifier it is sent for (`OpenSession.verifier`)

    def add(self, rows: int, seconds: float) -> None:
        samples = self.live.get(int(rows))
        if samples is None or not (seconds > 0 and math.isfinite(seconds)):
            return
        samples.append(seconds)
        del samples[:-self.WINDOW]

    def points(self) -> list[tuple[int, float]]:
        seen = {r: median(v) for r, v in self.live.items() if len(v) >= self.MIN_LIVE}
        trees = [seen[r] / self.start[r] for r in seen if r > 1] or [seen[r] / self.start[r] for r in seen]
        k = median(trees) if trees else 1.0
        return [(r, seen.get(r, s * k if r > 1 else s)) for r, s in sorted(self.start.items())]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b by Gaussian elimination with partial pivoting (tiny systems); None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-18:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                k = m[r][col] / m[col][col]
                m[r] = [x - k * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


@dataclass
class Costs:
    """What one process has measured: its drafter's calls (`draft`: one tree; `draft_many`: trees
    at several roots at once, whose first forward feeds every root), the target's verifications
    (reported by the verifier with each commit) and the link's share of a step (the time from
    sending a tree to its commit, less the verification)."""

    draft: LinearCost = field(default_factory=lambda: LinearCost((0.002, 0.0002, 0.00002, 0.0)))  # levels, rows, fed, 1
    draft_many: LinearCost = field(default_factory=lambda: LinearCost((0.002, 0.0002, 0.00002, 0.0)))
    verify: LinearCost = field(default_factory=lambda: RowCost((0.02, 0.002)))  # 1, rows
    # the same while the drafter predrafted beside it: on a CPU the two share memory bandwidth
    # (and maybe a core), so an overlapped verification can cost more than one alone
    verify_overlapped: LinearCost = field(default_factory=lambda: RowCost((0.02, 0.002)))
    link_s: float = 0.002  # the median of the last LINK_WINDOW samples (`add_link`)
    verify_points: tuple[tuple[int, float], ...] = ()  # the verifier's calibration, as last taken
    # per kind of PERIOD_KINDS (`add_period`): decayed sums [measured period, the plans' predicted
    # period, steps counted]
    _periods: dict[str, list[float]] = field(default_factory=lambda: {k: [0.0, 0.0, 0.0] for k in PERIOD_KINDS})
    _links: list[float] = field(default_factory=list)
    _verifiers: OrderedDict = field(default_factory=OrderedDict, repr=False, compare=False)  # key -> Costs (`of_verifier`)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def of_verifier(self, key: str) -> "Costs":
        """The costs of the sessions of the verifier named `key` (`OpenSession.verifier`): this
        process's drafting fits, shared (its own calls cost what they cost whoever asked), and that
        verifier's own verification, link and step periods. A drafter serving several verifiers
        (pods on other hardware; a pipelined and a taking-turns one) otherwise priced every tree by
        whichever verifier opened a session last, and refitted its verification to that one's
        points at every open, losing the live scale. An empty key: these costs themselves."""
        if not key:
            return self
        with self._lock:
            costs = self._verifiers.pop(key, None) or Costs(draft=self.draft, draft_many=self.draft_many)
            self._verifiers[key] = costs
            while len(self._verifiers) > MAX_VERIFIERS:
                self._verifiers.popitem(last=False)
            return costs

    def by_verifier(self) -> list[tuple[str, "Costs"]]:
        """(key, costs) of each verifier whose sessions were planned here ("": sessions that named
        none, listed while there are such, or no others)."""
        with self._lock:
            named = list(self._verifiers.items())
        return ([("", self)] if self.verify_known or not named else []) + named

    def set_verify_cost(self, points) -> None:
        """The verifier's own steps measured at its start, (rows, seconds): the shape of both
        verification fits (taken once per distinct set: every session of that verifier sends it)."""
        points = tuple((int(r), float(s)) for r, s in points)
        if not points or points == self.verify_points:
            return
        before = self.one_row_s() if self.verify_points else 0.0
        self.verify_points = points
        for fit in (self.verify, self.verify_overlapped):
            fit.fit_shape([((1.0, float(r)), s) for r, s in points])
        if before > 0:
            # plain runs were predicted from the old one-row point, and their period ratio holds the
            # error of that point; the verifier corrected it (its live steps): the plain periods'
            # predictions are restated at the new point, so the correction is not counted twice (a
            # start-up point of 7 ms against 11 live once left plain runs priced 1.3x, and a SmolLM2
            # session drafted one-node trees that lost to the plain steps it priced too dear)
            self._periods[PLAIN][1] *= self.one_row_s() / before

    def verify_s(self, rows: float, overlapped: bool) -> float:
        """A verification's cost by rows, overlapped with predrafting or not (each fit stands in for
        the other until that one has samples)."""
        use_overlapped = self.verify_overlapped.samples and (overlapped or not self.verify.samples)
        return (self.verify_overlapped if use_overlapped else self.verify)(1.0, rows)

    def one_row_s(self) -> float:
        """A one-row step as a plain run takes it: the verifier's own point (`StepTable`: measured
        in runs, corrected by its live one-row steps), not rescaled by the trees' verifications
        that this process measured (a tree among plain steps costs more than a run's step); plain
        runs' own error is their period ratio. Without the verifier's points, the live fit."""
        return self.verify.guess((1.0, 1.0)) if self.verify_points else self.verify_s(1, False)

    def many(self, levels: float, rows: float, fed: float) -> float:
        """A draft_many call's cost: its own fit once measured, the single-tree fit until then."""
        fit = self.draft_many if self.draft_many.samples or self.draft_many.calibrated else self.draft
        return fit(levels, rows, fed, 1.0)

    @property
    def verify_known(self) -> bool:
        """Whether any verification was measured (the verifier's calibration or a step): before
        that, a plan's step time is the priors' guess, and its error says nothing."""
        return bool(self.verify_points or self.verify.samples or self.verify_overlapped.samples)

    def add_period(self, kind: str, predicted: float, measured: float) -> None:
        """One step's period as the drafter saw it (from the commit before to this step's commit),
        against what the plan that chose the step predicted before any measured ratio
        (`Plan.predicted_s`); `kind`: the plan's (`Plan.kind`, one of PERIOD_KINDS)."""
        if not (predicted > 0 and measured > 0 and math.isfinite(measured)):
            return
        # evidence ages mostly with steps of its own kind: steps planned another way (while that
        # kind loses, or in sessions that never pipeline) keep it, so a verdict holds across
        # sessions and is revisited only slowly (a plain run's probes keep trees measured)
        for k, sums in self._periods.items():
            sums[:] = [(PERIOD_FORGET if k == kind else CROSS_FORGET) * x for x in sums]
        sums = self._periods[kind]
        sums[0] += measured
        sums[1] += predicted
        sums[2] += 1.0

    def period_ratio(self, kind: str) -> float:
        """Measured over predicted step period, for plans of that kind: the ratio of the decayed
        sums (a hit step's short period and a miss's long one average out, as the plan's expected
        step does), shrunk towards 1 by PERIOD_PRIOR steps. A plan's predicted step is multiplied
        by its kind's ratio; its period is measured against the step before that
        (`Plan.predicted_s`), so the ratio is the prediction's own error."""
        measured, predicted, n = self._periods[kind]
        if predicted <= 0:
            return 1.0
        return (n * measured / predicted + PERIOD_PRIOR) / (n + PERIOD_PRIOR)

    def add_link(self, seconds: float) -> None:
        """One window's link share. The estimate is a median, not a mean: one window that held
        something else (a verifier's prefill, a pause of the host) once put a mean at 50-70x the
        link for a dozen steps, and every tree was priced that much dearer."""
        if seconds >= 0 and math.isfinite(seconds):
            self._links.append(seconds)
            del self._links[:-LINK_WINDOW]
            self.link_s = median(self._links)
