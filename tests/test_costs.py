"""Tests for specmesh.costs: the online cost fits (`LinearCost`, `RowCost`), the verifier's step
table (`StepTable`), and what `Costs` keeps of verifications and step periods."""

from __future__ import annotations

import pytest

from specmesh.costs import OVERLAPPED, PLAIN, SPECULATIVE, Costs, LinearCost, RowCost, StepTable


def test_linear_cost_calibration_fits_exact_samples() -> None:
    fit = LinearCost((1.0, 1.0, 1.0))
    truth = (0.010, 0.002, 0.003)
    fit.fit_shape([((levels, rows, 1.0), truth[0] * levels + truth[1] * rows + truth[2])
                   for levels, rows in [(4, 4), (2, 16), (4, 8), (5, 40), (1, 1), (3, 12)]])
    assert fit.calibrated and fit.coef == pytest.approx(truth, rel=1e-6)


def test_linear_cost_calibration_never_goes_negative() -> None:
    """Samples a line with a negative intercept would fit best: the intercept is left out and the
    slope refitted, so no amount of work is predicted to take negative time."""
    fit = LinearCost((1.0, 1.0))
    fit.fit_shape([((1.0, 1.0), 0.001), ((1.0, 2.0), 0.010), ((1.0, 3.0), 0.019)])
    assert fit.coef[0] == 0.0 and fit.coef[1] > 0
    assert fit(1.0, 2.0) == pytest.approx((0.001 + 2 * 0.010 + 3 * 0.019) / 14 * 2, rel=1e-6)


def test_live_calls_rescale_the_calibrated_shape() -> None:
    """Calls now take twice what the calibration measured: every shape is predicted at twice its
    calibrated cost, also those the live calls never used."""
    fit = LinearCost((1.0, 1.0))
    fit.fit_shape([((1.0, r), 0.060 + 0.030 * r) for r in (1, 2, 3, 5, 9)])
    for _ in range(40):
        fit.add((1.0, 2.0), 2 * (0.060 + 0.030 * 2))
    assert fit(1.0, 9.0) == pytest.approx(2 * (0.060 + 0.030 * 9), rel=0.02)
    assert fit.coef[1] / fit.coef[0] == pytest.approx(0.5, rel=1e-6)


def test_one_slow_call_does_not_stick() -> None:
    """A slow first call at a wide shape, then calls of one shape only: predictions follow the
    recent calls at the calibrated shape (an online fit of both terms kept the slow call's slope
    for good and planned one-node trees)."""
    fit = LinearCost((1.0, 1.0))
    fit.fit_shape([((1.0, r), 0.060 + 0.030 * r) for r in (1, 2, 3, 5, 9)])
    fit.add((1.0, 9.0), 3.0)
    for _ in range(40):
        fit.add((1.0, 2.0), 0.120)
    assert fit(1.0, 5.0) == pytest.approx(0.210, rel=0.05)


def test_linear_cost_without_calibration_keeps_the_priors_shape() -> None:
    """Only one row count seen, no calibration: the prior's ratio of base to per-row cost stays,
    at the data's scale."""
    fit = LinearCost((1.0, 0.1))
    for _ in range(10):
        fit.add((1.0, 5.0), 0.030)
    assert fit(1.0, 5.0) == pytest.approx(0.030, rel=1e-3)
    assert fit.coef[1] / fit.coef[0] == pytest.approx(0.1, rel=1e-6)


def test_linear_cost_forgets_old_samples() -> None:
    fit = LinearCost((1.0, 0.0))
    for _ in range(50):
        fit.add((1.0, 1.0), 0.5)
    for _ in range(200):
        fit.add((1.0, 1.0), 0.1)
    assert fit(1.0, 1.0) == pytest.approx(0.1, rel=1e-2)


def test_costs_take_the_verifiers_points_once() -> None:
    """Every session of a verifier sends its calibration: the shape is taken when it changes, and
    the live scale is kept otherwise."""
    costs = Costs()
    points = [(1, 0.09), (2, 0.12), (3, 0.15), (5, 0.21), (9, 0.33)]
    costs.set_verify_cost(points)
    assert costs.verify_s(9, False) == pytest.approx(0.33, rel=1e-3)
    for _ in range(30):
        costs.verify.add((1.0, 2.0), 0.24)
    costs.set_verify_cost(points)
    assert costs.verify_s(9, False) == pytest.approx(0.66, rel=0.02)


# a CPU verifier's step by rows (ms, Qwen2.5-Coder 1.5B, one thread): past 8 rows the kernel's
# tile of activation rows reads the weights again
KINKED = [(1, 0.049), (2, 0.062), (3, 0.073), (4, 0.084), (5, 0.091), (6, 0.102), (7, 0.117), (8, 0.127),
          (9, 0.159), (13, 0.200), (17, 0.268)]


def test_row_cost_follows_the_measured_steps() -> None:
    """The verification's shape is the verifier's points, linear between them and, past the last,
    along the line through the first and the last; a line fitted through them put 5 rows far
    above what 5 rows measured (and 1 row below), and the planner drafted too little."""
    fit = RowCost((1.0, 1.0))
    fit.fit_shape([((1.0, float(r)), s) for r, s in KINKED])
    assert fit(1.0, 5.0) == pytest.approx(0.091)
    assert fit(1.0, 1.0) == pytest.approx(0.049)
    assert fit(1.0, 11.0) == pytest.approx((0.159 + 0.200) / 2)
    assert fit(1.0, 21.0) == pytest.approx(0.268 + 4 * (0.268 - 0.049) / 16)
    line = LinearCost((1.0, 1.0))
    line.fit_shape([((1.0, float(r)), s) for r, s in KINKED])
    assert line(1.0, 1.0) < 0.045 and line(1.0, 5.0) / line(1.0, 1.0) > 2.0 > fit(1.0, 5.0) / fit(1.0, 1.0)


def test_row_cost_takes_the_fastest_of_repeated_points_and_rescales_live() -> None:
    fit = RowCost((1.0, 1.0))
    fit.fit_shape([((1.0, 1.0), 0.05), ((1.0, 1.0), 0.04), ((1.0, 3.0), 0.06)])
    assert fit.points == ((1.0, 0.04), (3.0, 0.06))
    for _ in range(40):
        fit.add((1.0, 3.0), 0.12)
    assert fit(1.0, 2.0) == pytest.approx(0.10, rel=0.02)


def test_one_row_count_is_no_shape() -> None:
    """One point says nothing of how rows cost: the prior line stays, as `LinearCost` keeps it."""
    fit = RowCost((0.5, 0.1))
    fit.fit_shape([((1.0, 4.0), 0.09)])
    assert not fit.points and not fit.calibrated and fit(1.0, 4.0) == pytest.approx(0.9)


def test_step_table_corrects_a_wrong_start_by_live_steps() -> None:
    """Measured at start with the drafter loading beside it, one row came out 20% cheap: live
    plain steps put it back, the row counts not run yet follow the live/start ratio, and a probe's
    5-row steps take their own measured cost."""
    table = StepTable([(1, 0.030), (3, 0.040), (5, 0.053), (9, 0.080)])
    assert table.points() == [(1, 0.030), (3, 0.040), (5, 0.053), (9, 0.080)]
    for s in (0.037, 0.036, 0.5, 0.037):  # one step slowed by something else: the median ignores it
        table.add(1, s)
    assert dict(table.points())[1] == pytest.approx(0.037)
    assert dict(table.points())[5] == pytest.approx(0.053 * 0.037 / 0.030)
    for _ in range(3):
        table.add(5, 0.050)
    points = dict(table.points())
    assert points[5] == pytest.approx(0.050) and points[1] == pytest.approx(0.037)
    assert points[5] / points[1] < 0.053 / 0.030
    table.add(4, 1.0)  # a row count not measured at start: not kept
    assert [r for r, _ in table.points()] == [1, 3, 5, 9]


def test_step_table_does_not_price_plain_runs_by_the_trees() -> None:
    """Trees among plain steps ran 1.36x their start points (the SmolLM2 pair on an Intel Xeon: the
    caches refill after each change of rows), one-row steps in runs as measured at start: the trees'
    ratio moves the tree row counts not run yet, not the one-row step, until one-row steps are seen."""
    table = StepTable([(1, 0.0058), (3, 0.0066), (5, 0.0082), (9, 0.011)])
    for _ in range(3):
        table.add(3, 0.0066 * 1.36)
    points = dict(table.points())
    assert points[1] == pytest.approx(0.0058)
    assert points[5] == pytest.approx(0.0082 * 1.36) and points[9] == pytest.approx(0.011 * 1.36)
    for _ in range(3):
        table.add(1, 0.0061)
    points = dict(table.points())
    assert points[1] == pytest.approx(0.0061) and points[5] == pytest.approx(0.0082 * 1.36)


def test_step_table_keeps_the_recent_window() -> None:
    table = StepTable([(1, 0.03), (2, 0.04)])
    for _ in range(StepTable.WINDOW):
        table.add(1, 0.10)
    for _ in range(StepTable.WINDOW // 2 + 1):
        table.add(1, 0.02)
    assert dict(table.points())[1] == pytest.approx(0.02)


def test_period_ratio_averages_hits_and_misses_as_the_plan_does() -> None:
    """A pipelined plan predicts the mean of a short hit step and a long miss: steps measured
    at exactly those two lengths, half and half, are on prediction (ratio of sums, not a mean
    of per-step ratios, which would call them fast)."""
    costs = Costs()
    for _ in range(50):
        costs.add_period(OVERLAPPED, 0.2, 0.1)
        costs.add_period(OVERLAPPED, 0.2, 0.3)
    assert costs.period_ratio(OVERLAPPED) == pytest.approx(1.0, abs=0.01)
    assert costs.period_ratio(SPECULATIVE) == costs.period_ratio(PLAIN) == 1.0


def test_a_corrected_one_row_point_is_not_counted_twice_in_the_plain_ratio() -> None:
    """Plain runs measured 1.5x their prediction from a one-row point the verifier then corrects by
    its live steps: the plain periods' predictions are restated at the new point, so the plain
    ratio no longer holds the error that the point itself now carries."""
    costs = Costs()
    costs.set_verify_cost([(1, 0.010), (3, 0.015)])
    for _ in range(8):
        costs.add_period(PLAIN, 16 * costs.one_row_s(), 16 * 0.015)
    assert costs.period_ratio(PLAIN) > 1.35
    costs.set_verify_cost([(1, 0.015), (3, 0.020)])
    assert costs.one_row_s() == pytest.approx(0.015)
    assert costs.period_ratio(PLAIN) == pytest.approx(1.0, abs=0.01)
