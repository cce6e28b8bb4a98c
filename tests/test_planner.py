"""Tests for specmesh.planner: acceptance statistics, expected tokens on a tree, and the plans
chosen over synthetic cost tables (a GPU-like drafter whose width is free, a CPU-like one whose
width costs, drafters slower and faster than the verification). The cost fits themselves:
tests/test_costs.py."""

from __future__ import annotations

import pytest

from specmesh.costs import OVERLAPPED, PLAIN, SPECULATIVE, Costs, LinearCost
from specmesh.planner import (
    MAX_OUTCOMES,
    OVERLAP_MARGIN,
    Acceptance,
    expected_tokens,
    outcome_odds,
    plan,
    rates,
    shape_of,
    topology,
)


def _costs(level_s: float, row_s: float, verify_s: float, verify_row_s: float = 0.0, link_s: float = 0.0,
           fed_s: float = 0.0) -> Costs:
    """A synthetic cost table: a draft call costs level_s per level + row_s per tree row + fed_s
    per committed token it feeds first."""
    return Costs(draft=LinearCost((level_s, row_s, fed_s, 0.0)), verify=LinearCost((verify_s, verify_row_s)),
                 link_s=link_s)


def _acceptance(alpha: float, side: float = 0.1, n: float = 1000.0) -> Acceptance:
    """Evidence that rank-0 children are accepted with probability alpha, later ranks `side`."""
    acc = Acceptance()
    for d in range(len(acc.tried)):
        for r in range(len(acc.tried[d])):
            acc.tried[d][r] = n
            acc.accepted[d][r] = n * (alpha if r == 0 else side)
    return acc


def test_plain_runs_are_priced_by_the_verifiers_one_row_step_not_the_trees() -> None:
    """The drafter's live verifications (trees) run 1.36x the verifier's points: tree plans are
    priced by them, the plain run by the verifier's own one-row point. At acceptance 0.6 a tree
    then loses to plain steps (a two-node tree: 1.96 tokens in about 13.8 ms, against 6.1 ms a
    token); priced by the trees' scale too, plain steps looked 36% dearer and the session kept
    drafting at a loss (0.88x of plain decoding, measured)."""
    costs = Costs(draft=LinearCost((0.0012, 0.0002, 0.00003, 0.0003)), link_s=0.0018)
    costs.set_verify_cost([(1, 0.0058), (2, 0.0061), (3, 0.0066), (5, 0.0082), (9, 0.011)])
    for _ in range(30):
        costs.verify.add((1.0, 3.0), 0.0066 * 1.36)
    p = plan(costs, _acceptance(0.6, n=40.0), 8, 4, pipelined=False, batched=False, plain_run=8)
    assert p.budget == 0 and p.step_s == pytest.approx(0.0058 + 0.0018 / 8 + 0.00003)
    assert costs.verify_s(3, False) == pytest.approx(0.0066 * 1.36, rel=0.01)
    # where the session's acceptance makes trees pay, trees are still planned
    assert plan(costs, _acceptance(0.8, n=40.0), 8, 4, pipelined=False, batched=False, plain_run=8).budget == 3


def test_acceptance_counts_the_tried_ranks_along_the_accepted_path() -> None:
    #      root
    #     /    \
    #    0      1
    #   / \
    #  2   3
    parents = [-1, -1, 0, 0]
    acc = Acceptance()
    acc.observe(parents, [0, 3])  # rank 0 at depth 1, then rank 1 at depth 2 (rank 0 rejected)
    assert acc.tried[0][:2] == [1, 0] and acc.accepted[0][:2] == [1, 0]
    assert acc.tried[1][:2] == [1, 1] and acc.accepted[1][:2] == [0, 1]
    acc.observe(parents, [])  # nothing accepted: both root children tried
    assert acc.tried[0][:2] == [2, 1] and acc.accepted[0][:2] == [1, 0]


def test_a_depth_never_reached_takes_the_sessions_pooled_rate() -> None:
    # chains of 4 all accepted: depth 5 (the bonus a predraft bets on) was never tried, and its
    # estimate follows the evidence at depths 1-4, not the fixed prior
    acc = Acceptance()
    for _ in range(50):
        acc.observe([-1, 0, 1, 2], [0, 1, 2, 3])
    assert acc.rate(5, 0) > 0.9
    assert acc.rate(5, 0) == pytest.approx(rates(acc)[4][0])
    for _ in range(50):  # and evidence of its own at a depth outweighs the pooled prior
        acc.observe([-1, 0, 1, 2, 3], [0, 1, 2, 3])
    assert acc.rate(5, 0) < 0.1 < acc.rate(4, 0)


def _overlap_costs():
    """Width cheap, drafting faster than the verification, which measured 10% slower beside a
    predraft."""
    costs = _costs(0.01, 0.0005, 0.03, 0.004, link_s=0.002)
    costs.verify_overlapped = LinearCost((0.033, 0.0044))
    costs.verify_overlapped.add((1.0, 2.0), 0.0418)
    costs.verify.add((1.0, 2.0), 0.038)
    return costs


def test_bonus_hits_below_prediction_turn_predrafting_off() -> None:
    # a drafter whose width is cheap, the verification slower than drafting (10% slower beside a
    # predraft, as measured): predrafting pays (by more than OVERLAP_MARGIN) while the bonus
    # candidates hit as their rank rates say, and stops once the session shows that they hit far
    # less often (as a feature drafter's guesses from predicted features do)
    costs = _overlap_costs()
    acc = _acceptance(0.8, n=1000.0)
    ahead = plan(costs, acc, 8, 4, pipelined=True, batched=False)
    assert ahead.outcomes
    assert ahead.tokens_per_s > (1 + OVERLAP_MARGIN) * plan(costs, acc, 8, 4, pipelined=False, batched=False).tokens_per_s
    for _ in range(200):
        acc.observe_bonus(0.6, False)
    assert acc.bonus_calibration < 0.05
    assert not plan(costs, acc, 8, 4, pipelined=True, batched=False).outcomes
    assert acc.scaled(32.0).bonus_calibration == pytest.approx(
        (acc.bonus_hits * acc.scaled(32.0).bonus_expected / acc.bonus_expected + 2.0)
        / (acc.scaled(32.0).bonus_expected + 2.0))


def test_on_cores_the_verifier_takes_work_beside_it_is_priced_after_it() -> None:
    """The same costs where predrafting pays: a drafter on the verifier's cores (`specmesh up`'s
    services, each with every core, pipelining asked for) plans no predraft and no feeding beside
    the verification, and so the plain sequential step: on two cores the Qwen pair's pipelined
    rows ran 2-3% behind sequential ones while the planner tried overlapped steps, and one
    overlapped SmolLM2 step took what its drafting and verification take in turn."""
    costs = _overlap_costs()
    acc = _acceptance(0.8, n=1000.0)
    alone = plan(costs, acc, 8, 4, pipelined=False, batched=False)
    assert plan(costs, acc, 8, 4, pipelined=True, batched=False).outcomes
    shared = plan(costs, acc, 8, 4, pipelined=True, batched=True, shares_cores=True)
    assert not shared.overlapped and (shared.budget, shared.depth) == (alone.budget, alone.depth)
    assert shared.step_s == pytest.approx(alone.step_s)
    # no speculation either: feeding the drafter beside the plain steps is no cheaper than after
    plain = plan(costs, _acceptance(0.05, n=1000.0), 8, 4, pipelined=True, batched=False, plain_run=8,
                 shares_cores=True)
    assert plain.budget == 0 and not plain.feed


@pytest.mark.parametrize("alpha,depth", [(0.8, 4), (0.5, 3), (0.9, 8)])
def test_expected_tokens_of_a_chain_is_the_closed_form(alpha: float, depth: int) -> None:
    e = expected_tokens(topology(depth, depth), rates(_acceptance(alpha, n=1e9)))
    assert e == pytest.approx((1 - alpha ** (depth + 1)) / (1 - alpha), rel=1e-6)


def test_siblings_add_what_their_rank_is_accepted() -> None:
    # root with two children (ranks 0, 1): E = 1 + a0 + (1 - a0) a1
    e = expected_tokens(shape_of([-1, -1]), rates(_acceptance(0.6, side=0.3, n=1e9)))
    assert e == pytest.approx(1 + 0.6 + 0.4 * 0.3, rel=1e-6)


def test_outcome_odds_rank_the_observed_outcome_first() -> None:
    t = topology(4, 4)
    acc = Acceptance()
    for _ in range(40):  # the first two tokens accepted, the third rejected, again and again
        acc.observe(list(t.parents), [0, 1])
    odds = outcome_odds(t, rates(acc))
    assert [k for k, _, _ in odds] == [0, 1, 2, 3, 4]
    assert max(odds, key=lambda o: o[1])[0] == 2
    assert sum(p for _, p, _ in odds) <= 1.0 + 1e-9


def test_plans_stay_within_the_caps_and_fixed_keeps_them() -> None:
    costs, acc = _costs(0.001, 0.0, 0.05), _acceptance(0.95)
    for b, d in [(8, 4), (3, 3), (16, 2), (1, 1)]:
        p = plan(costs, acc, b, d, pipelined=True, batched=True)
        assert 1 <= p.depth <= d and p.depth <= p.budget <= b
        f = plan(costs, acc, b, d, pipelined=True, batched=True, fixed=True)
        assert (f.budget, f.depth) == (b, d)


def test_high_acceptance_drafts_deeper_than_low() -> None:
    costs = _costs(0.01, 0.0005, 0.05)
    deep = plan(costs, _acceptance(0.9), 16, 8, pipelined=False, batched=True)
    shallow = plan(costs, _acceptance(0.2), 16, 8, pipelined=False, batched=True)
    assert deep.depth > shallow.depth


def test_width_that_costs_gets_narrower_trees_and_fewer_predrafts() -> None:
    """The same verifier and acceptance; a level of the drafter costs the same, but on the CPU
    each row of it costs too: the CPU plan predrafts fewer outcomes with no wider trees."""
    acc = _acceptance(0.8, side=0.2)
    gpu = plan(_costs(0.01, 0.0, 0.1), acc, 16, 4, pipelined=True, batched=True)
    cpu = plan(_costs(0.01, 0.004, 0.1), acc, 16, 4, pipelined=True, batched=True)
    assert gpu.outcomes and len(gpu.outcomes) == min(MAX_OUTCOMES, 5)
    assert len(cpu.outcomes) < len(gpu.outcomes)
    assert cpu.budget <= gpu.budget


def test_pipelining_only_where_it_is_predicted_to_win() -> None:
    acc = _acceptance(0.8)
    # a drafter whose tree takes far longer than the verification: predrafting would delay misses
    slow = plan(_costs(0.2, 0.01, 0.01), acc, 8, 4, pipelined=True, batched=True)
    assert slow.outcomes == ()
    # a drafter cheaper than the verification: predraft, and the step takes about one verification
    fast = plan(_costs(0.005, 0.0, 0.1), acc, 8, 4, pipelined=True, batched=True)
    assert fast.outcomes and fast.step_s < 0.1 + 0.5 * fast.depth * 0.005 + 0.02
    assert plan(_costs(0.005, 0.0, 0.1), acc, 8, 4, pipelined=False, batched=True).outcomes == ()


def test_one_at_a_time_drafters_pay_per_predraft() -> None:
    """A drafter without draft_many predrafts each outcome in a call of its own: fewer fit."""
    acc, costs = _acceptance(0.8), _costs(0.01, 0.0, 0.1)
    batched = plan(costs, acc, 8, 4, pipelined=True, batched=True, fixed=True)
    single = plan(costs, acc, 8, 4, pipelined=True, batched=False, fixed=True)
    assert 1 <= len(single.outcomes) < len(batched.outcomes)


def test_plan_maximises_the_tokens_per_second_it_predicts() -> None:
    """No shape within the caps, pipelined or not, is predicted faster than the one chosen."""
    acc, costs = _acceptance(0.7, side=0.2), _costs(0.02, 0.003, 0.08, 0.004, 0.002)
    best = plan(costs, acc, 12, 5, pipelined=True, batched=True)
    for b in range(1, 13):
        for d in range(1, min(b, 5) + 1):
            other = plan(costs, acc, b, d, pipelined=True, batched=True, fixed=True)
            assert other.tokens_per_s <= best.tokens_per_s + 1e-9


def test_a_verification_slowed_by_predrafting_beside_it_turns_pipelining_off() -> None:
    """On a CPU the drafter's predrafts share memory bandwidth with the verification: once the
    overlapped verifications measure slow enough, drafting in turn is planned instead."""
    acc = _acceptance(0.8)
    costs = _costs(0.01, 0.002, 0.05)
    assert plan(costs, acc, 8, 4, pipelined=True, batched=True).outcomes  # not measured apart yet
    for rows in (1.0, 5.0, 9.0) * 10:
        costs.verify.add((1.0, rows), 0.05)  # alone
        costs.verify_overlapped.add((1.0, rows), 0.12)  # beside a predraft: more than double
    assert plan(costs, acc, 8, 4, pipelined=True, batched=True).outcomes == ()


def test_overlapped_steps_measured_slower_than_predicted_turn_pipelining_off() -> None:
    """What the cost terms cannot see (a drafter and a verifier contending for the same cores)
    shows in the measured step periods: once overlapped steps run 1.5x their predictions while
    sequential ones run as predicted, neither predrafts nor a plain run's feeding beside the
    verifier are planned; the verdict outlives a few sessions of sequential steps (it ages mostly
    with overlapped steps), and many of them bring pipelining back in time."""
    acc = _acceptance(0.8)
    costs = _costs(0.01, 0.002, 0.05, fed_s=0.001)
    assert plan(costs, acc, 8, 4, pipelined=True, batched=True).outcomes
    for _ in range(10):
        costs.add_period(OVERLAPPED, 0.1, 0.15)
        costs.add_period(SPECULATIVE, 0.1, 0.1)
    assert costs.period_ratio(OVERLAPPED) == pytest.approx(1.5, rel=0.1)
    assert plan(costs, acc, 8, 4, pipelined=True, batched=True).outcomes == ()
    assert plan(costs, acc, 8, 4, pipelined=True, batched=True, fixed=True).outcomes == ()
    slow = _costs(0.2, 0.01, 0.06, 0.03, link_s=0.02, fed_s=0.01)  # no tree pays: a plain run
    slow._periods = costs._periods
    plain = plan(slow, acc, 8, 4, pipelined=True, batched=True, plain_run=4)
    assert (plain.budget, plain.feed) == (0, False)
    assert plain.tokens_per_s == pytest.approx(1 / 0.105)  # V + link / 4 + the token fed later
    assert not plan(costs, acc, 8, 4, pipelined=False, batched=True).overlapped  # sequential: no factor
    for _ in range(100):
        costs.add_period(SPECULATIVE, 0.1, 0.1)
    assert plan(costs, acc, 8, 4, pipelined=True, batched=True).outcomes == ()
    for _ in range(1000):
        costs.add_period(SPECULATIVE, 0.1, 0.1)
    assert costs.period_ratio(OVERLAPPED) < 1.01
    assert plan(costs, acc, 8, 4, pipelined=True, batched=True).outcomes


def test_a_plan_from_the_priors_alone_says_so() -> None:
    """Before any verification was measured a plan's step time is the priors' guess: the drafter
    does not measure its error against it."""
    costs, acc = Costs(), _acceptance(0.8)
    assert not plan(costs, acc, 8, 4, pipelined=True, batched=True).informed
    costs.set_verify_cost([(1, 0.05), (9, 0.07)])
    assert plan(costs, acc, 8, 4, pipelined=True, batched=True).informed


def test_no_speculation_when_it_is_predicted_slower() -> None:
    """A drafter whose one level costs more than the verifier's step, and every row of the
    verification costing a third of a step: the empty tree (the verifier's one-row step) wins,
    unless the caps are fixed or a probe asks for a tree."""
    costs, acc = _costs(0.2, 0.01, 0.06, 0.03, link_s=0.02, fed_s=0.01), _acceptance(0.7)
    for pipelined in (False, True):
        p = plan(costs, acc, 8, 4, pipelined=pipelined, batched=True, plain_run=4)
        assert (p.budget, p.depth, p.outcomes) == (0, 0, ())
        # the verifier's one-row step, the link once in a run of 4; sequential, the drafter
        # feeding that token later (0.01)
        assert p.tokens_per_s == pytest.approx(1 / (0.095 if pipelined else 0.105))
        probe = plan(costs, acc, 8, 4, pipelined=pipelined, batched=True, speculate=True)
        assert probe.budget >= 1
    assert plan(costs, acc, 8, 4, pipelined=True, batched=True, fixed=True).budget == 8
    # a cheap drafter: speculation is back
    assert plan(_costs(0.005, 0.0, 0.06, 0.01), acc, 8, 4, pipelined=False, batched=True).budget >= 1


def test_one_predraft_is_priced_as_the_single_tree_call_it_is() -> None:
    """DraftAhead makes a lone predraft with `draft`, not `draft_many`: a costly draft_many fit
    (its per-call overhead) must not keep a lone predraft from being planned."""
    acc = _acceptance(0.8, side=0.1)
    costs = _costs(0.01, 0.0, 0.1, 0.01)
    costs.draft_many.fit_shape([((lv, rows, 0.0, 1.0), 0.01 * lv + 1.0) for lv, rows in [(1, 2), (2, 2), (3, 6), (2, 8)]])
    assert costs.many(2, 4, 0) == pytest.approx(1.02)  # one second a call
    p = plan(costs, acc, 1, 1, pipelined=True, batched=True, fixed=True)
    assert p.outcomes and len(p.outcomes) == 1


def test_a_plain_run_pays_the_link_once() -> None:
    """A link that costs as much as a verification row: one plain step at a time pays it every
    token and loses to a one-node tree; a run of 16 pays it once and wins, and the plan names the
    run it priced (the drafter asks the verifier for exactly that run)."""
    costs, acc = _costs(0.004, 0.001, 0.02, 0.002, link_s=0.01, fed_s=0.0001), _acceptance(0.45)
    assert plan(costs, acc, 8, 4, pipelined=False, batched=True, plain_run=1).budget >= 1
    plain = plan(costs, acc, 8, 4, pipelined=False, batched=True, plain_run=16)
    assert plain.budget == 0 and plain.run == 16


def test_a_predicted_near_tie_is_not_pipelined(monkeypatch: pytest.MonkeyPatch) -> None:
    # predrafting predicted ~2% faster than drafting in turn (a verification 10% slower beside a
    # predraft, acceptance 0.6): within OVERLAP_MARGIN, so the step is planned sequential; a
    # planner without the margin would have overlapped it
    costs = _overlap_costs()
    acc = _acceptance(0.6, n=1000.0)
    chosen = plan(costs, acc, 8, 4, pipelined=True, batched=False)
    sequential = plan(costs, acc, 8, 4, pipelined=False, batched=False)
    assert not chosen.overlapped and chosen == sequential
    monkeypatch.setattr("specmesh.planner.OVERLAP_MARGIN", 0.0)
    tie = plan(costs, acc, 8, 4, pipelined=True, batched=False)
    assert tie.overlapped and 1.0 < tie.tokens_per_s / sequential.tokens_per_s < 1.0 + OVERLAP_MARGIN


def test_drafting_for_several_sessions_in_turn_makes_trees_pay_less() -> None:
    # a tree pays for a drafter with one session; with 8 sessions drafted in turn each tree's
    # drafting counts 8 times (the others wait for it) and one-row steps, which need none, win
    costs = _costs(0.01, 0.001, 0.1, 0.01)
    acc = _acceptance(0.8, n=1000.0)
    alone = plan(costs, acc, 8, 4, pipelined=False, batched=False)
    assert alone.budget > 0
    shared = plan(costs, acc, 8, 4, pipelined=False, batched=False, sharing=8.0)
    assert shared.budget == 0
    some = plan(costs, acc, 8, 4, pipelined=False, batched=False, sharing=2.0)
    assert some.budget == 0 or some.budget <= alone.budget  # never a bigger tree for more sessions


def test_plain_runs_and_trees_are_each_judged_by_their_measured_periods() -> None:
    """The SmolLM2 pair through the services: the cost terms priced a small tree a little faster
    per token than one-row steps, while trees measured slower than planned (the first step after
    a change of rows pays for the caches, the link varies) and plain runs faster. Each kind's
    measured ratio scales its own plans, and is measured against the plan's step before that
    ratio: a ratio applied and then measured against would converge to its square root."""
    acc = _acceptance(0.5, side=0.1)
    costs = _costs(0.0012, 0.0001, 0.006, 0.001, link_s=0.0012, fed_s=0.0001)
    tree = plan(costs, acc, 8, 4, pipelined=False, batched=True, plain_run=8)
    assert tree.budget >= 1 and tree.kind == SPECULATIVE
    for _ in range(30):
        p = plan(costs, acc, 8, 4, pipelined=False, batched=True, plain_run=8, speculate=True)
        assert p.predicted_s == pytest.approx(p.step_s / costs.period_ratio(SPECULATIVE))
        costs.add_period(p.kind, p.predicted_s, 1.25 * p.predicted_s)
    assert costs.period_ratio(SPECULATIVE) == pytest.approx(1.25, rel=0.05)
    plain = plan(costs, acc, 8, 4, pipelined=False, batched=True, plain_run=8)
    assert (plain.budget, plain.kind) == (0, PLAIN)
    for _ in range(30):
        costs.add_period(PLAIN, plain.predicted_s, 0.9 * plain.predicted_s)
    assert costs.period_ratio(PLAIN) == pytest.approx(0.9, rel=0.05)
    again = plan(costs, acc, 8, 4, pipelined=False, batched=True, plain_run=8)
    assert again.budget == 0 and again.step_s == pytest.approx(again.predicted_s * costs.period_ratio(PLAIN))


def test_each_verifier_is_planned_from_its_own_costs() -> None:
    """A drafter serving two verifiers (a fast one and one 4x slower) keeps each one's verification,
    link and step periods apart, so sessions of each are planned from their own (trees pay against
    the slow verifier's one-row steps, not against the fast one's), while its own drafting costs are
    one set: a draft call costs what it costs whichever verifier asked."""
    from specmesh.costs import MAX_VERIFIERS

    process = Costs()
    fast, slow = process.of_verifier("fast"), process.of_verifier("slow")
    fast.set_verify_cost([(1, 0.010), (2, 0.020), (3, 0.030), (5, 0.050)])  # rows cost as much as one more step
    slow.set_verify_cost([(1, 0.040), (2, 0.041), (3, 0.042), (5, 0.044)])  # rows nearly free
    for _ in range(4):
        process.of_verifier("fast").add_link(0.004)
        fast.draft.add((2.0, 2.0, 0.0, 1.0), 0.006)
    assert process.of_verifier("slow") is slow and slow.draft is fast.draft is process.draft
    assert slow.one_row_s() == pytest.approx(0.040) and fast.one_row_s() == pytest.approx(0.010)
    assert fast.link_s == pytest.approx(0.004) and slow.link_s == Costs().link_s
    acc = Acceptance()
    for i in range(20):
        acc.observe([-1], [0] if i % 2 else [])  # half the first nodes accepted
    assert plan(slow, acc, 4, 4, pipelined=False, batched=False, plain_run=8).budget > 0  # trees win at 40 ms steps
    assert plan(fast, acc, 4, 4, pipelined=False, batched=False, plain_run=8).budget == 0  # plain at 10 ms ones
    assert [k for k, _ in process.by_verifier()] == ["fast", "slow"]
    for i in range(MAX_VERIFIERS):
        process.of_verifier(f"other {i}")
    assert "fast" not in dict(process.by_verifier()) and process.of_verifier("") is process


def test_trees_accepting_less_than_their_rates_expect_are_priced_by_what_they_got() -> None:
    """Rates that promise more than the verified trees delivered (a plan is chosen where the rates
    look best: after a run of acceptance a session expects more than it gets) scale down each
    tree's expected accepted tokens, and speculation that looked a little faster than plain
    decoding is planned plain; trees that deliver what was expected keep the plan as it was."""
    # a SmolLM2-like pair taking turns (ms: one-row step 4.5, a row more 0.8, a drafting level 1.0,
    # the link 1.5): chains of 2 predicted 5% faster than plain runs of 16 at 0.62 a token
    costs, acc = _costs(0.001, 0.0, 0.0045, 0.0008, link_s=0.0015, fed_s=0.00014), _acceptance(0.62)
    honest = plan(costs, acc, 8, 4, pipelined=False, batched=True, plain_run=16)
    assert honest.budget >= 1 and acc.tokens_calibration == pytest.approx(1.0)
    for _ in range(50):
        acc.observe_tokens(1.0, 1)  # as expected: nothing changes
    assert acc.tokens_calibration == pytest.approx(1.0)
    assert plan(costs, acc, 8, 4, pipelined=False, batched=True, plain_run=16) == honest
    for i in range(100):
        acc.observe_tokens(1.0, 0 if i % 4 else 2)  # half of what was expected, on average
    assert acc.tokens_calibration == pytest.approx((50 + 50 + 4) / (150 + 4))
    low = plan(costs, acc, 8, 4, pipelined=False, batched=True, plain_run=16)
    assert low.budget == 0
    # a tree's expectation stays within what it can hold, and the ratio within CALIBRATION_RANGE
    assert Acceptance(tokens_seen=1000.0, tokens_expected=10.0).tokens_calibration == 1.5
    sure = _acceptance(0.99)
    sure.tokens_seen, sure.tokens_expected = 1000.0, 10.0
    assert plan(costs, sure, 4, 4, pipelined=False, batched=True, fixed=True).tokens_per_step == pytest.approx(5.0)
    # a new session takes the recent sessions' verdict, at most CALIBRATION_KEEP tokens of it
    prior = acc.scaled(4.0)
    assert prior.tokens_expected == pytest.approx(32.0)
    assert prior.tokens_calibration < 0.85
