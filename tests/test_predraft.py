"""Tests for specmesh.drafters.predraft: re-rooting and trimming trees, the DraftAhead session
(predraft hits and misses give the trees a fresh draft would), and that output drawn through
predrafted (re-rooted) trees is still distributed exactly as the target's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specmesh.costs import OVERLAPPED, SPECULATIVE, Costs, LinearCost
from specmesh.drafters import NgramDrafter, pick, predraft
from specmesh.drafters.base import Children, ContextSession, children_from_probs, grow_tree, grow_trees
from specmesh.drafters.predraft import (
    DraftAhead,
    SessionClosedError,
    draft_generator,
    main_path,
    pick_predrafted,
    predraft_shape,
    subtree,
    trim,
    trim_nodes,
    useful_depth,
)
from specmesh.planner import MAX_OUTCOMES, Acceptance
from specmesh.sampling import SamplingParams, make_generator, sample_token, verify_sampling
from specmesh.tree import ROOT, DraftTree, children_of, depths, validate_tree

GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=1.0, seed=3)


def eager() -> Costs:
    """Costs under which predrafting every outcome is worth it: drafting nearly free (what the
    tests' drafters measure stays far below), verification slow (never reported here)."""
    return Costs(draft=LinearCost((1e-6, 1e-7, 0.0, 0.0)), verify=LinearCost((1.0, 0.0)))


@pytest.fixture(autouse=True)
def _no_overlap_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    # these tests check predrafting's mechanics under `eager` costs, where drafting is nearly
    # free: predrafting gains next to nothing there, so the margin an overlapped plan must win by
    # (tests/test_planner.py::test_a_predicted_near_tie_is_not_pipelined) is set aside
    monkeypatch.setattr("specmesh.planner.OVERLAP_MARGIN", 0.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#          root
#        /  |   \
#      0:5 1:6  2:7
#     / \    \
#   3:8 4:9  5:3
#    |
#   6:4
LITERAL = DraftTree(
    tokens=[5, 6, 7, 8, 9, 3, 4],
    parents=[-1, -1, -1, 0, 0, 1, 3],
    q_nodes=[ROOT, 0, 1, 3],
    q_ids=[[5, 6, 7], [8, 9], [3, 1], [4]],
    q_probs=[[0.5, 0.3, 0.2], [0.6, 0.4], [0.9, 0.1], [1.0]],
)


def test_main_path_follows_first_children() -> None:
    assert main_path(LITERAL) == [0, 3, 6]
    assert main_path(DraftTree.empty()) == []
    assert main_path(DraftTree.chain([4, 5, 6])) == [0, 1, 2]
    # the first child is followed even when a later sibling goes deeper
    assert main_path(DraftTree([1, 2, 3], [-1, -1, 1])) == [0]


def test_subtree_remaps_parents_and_q() -> None:
    sub = subtree(LITERAL, 0)
    assert sub.tokens == [8, 9, 4]
    assert sub.parents == [-1, -1, 0]
    assert sub.q_nodes == [ROOT, 0]
    assert sub.q_ids == [[8, 9], [4]] and sub.q_probs == [[0.6, 0.4], [1.0]]
    validate_tree(sub, vocab_size=10, max_nodes=8, need_q=True)

    sub1 = subtree(LITERAL, 1)
    assert (sub1.tokens, sub1.parents, sub1.q_nodes, sub1.q_ids) == ([3], [-1], [ROOT], [[3, 1]])
    assert subtree(LITERAL, 3) == DraftTree([4], [-1], [ROOT], [[4]], [[1.0]])
    assert subtree(LITERAL, 6) == DraftTree.empty()  # a leaf


def test_subtree_of_greedy_tree_has_no_q() -> None:
    sub = subtree(DraftTree([1, 2, 3, 4], [-1, 0, 0, 1]), 0)
    assert (sub.tokens, sub.parents, sub.q_nodes) == ([2, 3, 4], [-1, -1, 0], [])


@pytest.mark.parametrize("budget, depth, tokens, parents", [
    (7, 4, [5, 6, 7, 8, 9, 3, 4], [-1, -1, -1, 0, 0, 1, 3]),
    (4, 4, [5, 6, 8, 4], [-1, -1, 0, 2]),  # the main path first, then index order
    (3, 4, [5, 8, 4], [-1, 0, 1]),
    (7, 1, [5, 6, 7], [-1, -1, -1]),
    (5, 2, [5, 6, 7, 8, 9], [-1, -1, -1, 0, 0]),
    (1, 3, [5], [-1]),
])
def test_trim_literal(budget: int, depth: int, tokens: list[int], parents: list[int]) -> None:
    out = trim(LITERAL, budget, depth)
    assert (out.tokens, out.parents) == (tokens, parents)
    validate_tree(out, vocab_size=10, max_nodes=budget, max_depth=depth, need_q=True)
    assert ROOT in out.q_nodes and all(n in out.parents for n in out.q_nodes), "q only for expanded nodes"


def _sampling_tree(seed: int, budget: int = 24, depth: int = 5, vocab: int = 12) -> DraftTree:
    """A grow_tree sampling tree: every node's children i.i.d. from a random q it reports."""
    gen = torch.Generator().manual_seed(seed)

    def expand(_nodes, _paths, counts):
        out = []
        for count in counts:
            probs = torch.softmax(torch.randn(vocab, generator=gen) * 2, dim=-1)  # [V]
            out.append(children_from_probs(probs, count, SAMPLE, gen, q_top=6))
        return out

    return grow_tree(expand, budget, depth)


@pytest.mark.parametrize("seed", range(6))
def test_sampling_subtree_and_trim_stay_valid(seed: int) -> None:
    tree = _sampling_tree(seed)
    validate_tree(tree, vocab_size=12, max_nodes=64, need_q=True)
    kids = children_of(tree)
    q_of = {n: (i, p) for n, i, p in zip(tree.q_nodes, tree.q_ids, tree.q_probs)}
    for node in range(len(tree)):
        sub = subtree(tree, node)
        validate_tree(sub, vocab_size=12, max_nodes=64, need_q=bool(sub.tokens))
        if kids[node]:
            assert sub.q_nodes[0] == ROOT and (sub.q_ids[0], sub.q_probs[0]) == q_of[node], "q kept exactly"
        for budget in (1, 3, 7, 64):
            for depth in (1, 2, 4):
                out = trim(sub, budget, depth)
                validate_tree(out, vocab_size=12, max_nodes=budget, max_depth=depth, need_q=bool(out.tokens))
                _assert_children_prefixes(sub, trim_nodes(sub, budget, depth))
                if sub.tokens:  # the main path survives as deep as allowed
                    assert len(main_path(out)) == min(len(main_path(sub)), budget, depth)


def _assert_children_prefixes(tree: DraftTree, kept: list[int]) -> None:
    """Each kept node keeps a prefix of its children in index order (never a value-based pick)."""
    kids = children_of(tree)
    kept_set = set(kept)
    assert all(tree.parents[i] == ROOT or tree.parents[i] in kept_set for i in kept), "closed under parents"
    for node in [ROOT, *kept]:
        mask = [c in kept_set for c in kids[node]]
        assert mask == sorted(mask, reverse=True), f"node {node}: kept children are not a prefix"


def test_pick_predrafted() -> None:
    # P: root children 5 (with children), 6 (leaf), 5 again (with a child)
    p = DraftTree([5, 6, 5, 1, 2, 3], [-1, -1, -1, 0, 0, 2])
    assert pick_predrafted(p, 5, 8, 4) == DraftTree([1, 2], [-1, -1])
    assert pick_predrafted(p, 5, 1, 4) == DraftTree([1], [-1])
    assert pick_predrafted(p, 6, 8, 4) is None  # a leaf: nothing predrafted under it
    assert pick_predrafted(p, 7, 8, 4) is None
    assert pick_predrafted(p, 5, 8, 4, min_depth=2) is None  # one level deep: not worth it
    assert pick_predrafted(p, 5, 8, 4, min_depth=1) == DraftTree([1, 2], [-1, -1])
    assert useful_depth(4, GREEDY) == 2 and useful_depth(5, GREEDY) == 3 and useful_depth(4, SAMPLE) == 1
    assert predraft_shape(8, 4) == (18, 5, 2) and predraft_shape(64, 16) == (64, 17, 2)


def test_draft_generator_is_seeded_but_not_the_verifiers_stream() -> None:
    a, b = draft_generator(SAMPLE), draft_generator(SAMPLE)
    verifier = make_generator(SAMPLE)
    x, y, z = (torch.rand(8, generator=g) for g in (a, b, verifier))
    assert torch.equal(x, y)
    assert not torch.equal(x, z)


# --- DraftAhead on the ngram drafter: hits, misses and extends give exactly the right trees ---

CONTEXT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2, 3]


def _fresh(context: list[int], budget: int, depth: int) -> DraftTree:
    return NgramDrafter().open(list(context)).draft(budget, depth, GREEDY, make_generator(GREEDY))


def _units(ahead: DraftAhead) -> int:
    n = 0
    while ahead.predraft():
        n += 1
    return n


def test_draft_ahead_hit_and_miss_ngram() -> None:
    ctx = list(CONTEXT)
    ahead = DraftAhead(NgramDrafter().open(ctx), len(ctx), GREEDY, pipelined=True, costs=eager(), fixed=True)
    first = ahead.first(8, 4)
    assert (first.step, first.position, first.predrafted) == (0, len(ctx), False)
    assert first.tree == _fresh(ctx, 8, 4)
    h = [first.tree.tokens[i] for i in main_path(first.tree)]

    # hit: the main path accepted whole, the bonus is the predraft's first root child
    assert _units(ahead) == min(MAX_OUTCOMES, len(h) + 1) and not ahead.predraft()  # every outcome, once
    b, d, w = predraft_shape(8, 4)
    p = NgramDrafter().open(ctx + h).draft(b, d, GREEDY, make_generator(GREEDY), (), w)
    bonus = p.tokens[0]
    hit = ahead.commit(0, h, bonus, 8, 4)
    ctx += h + [bonus]
    assert (hit.step, hit.position, hit.predrafted) == (1, len(ctx), True)
    assert hit.tree == pick_predrafted(p, bonus, 8, 4)

    # miss: a shorter accepted path and a bonus no predraft has; the tree is what a fresh session
    # drafts at that point
    assert _units(ahead) >= 1
    h2 = [hit.tree.tokens[i] for i in main_path(hit.tree)]
    miss = ahead.commit(1, h2[:1], 77, 6, 3)
    ctx += h2[:1] + [77]
    assert (miss.step, miss.position, miss.predrafted) == (2, len(ctx), False)
    assert miss.tree == _fresh(ctx, 6, 3)

    # extend (after an empty tree: nothing to predraft), the new tokens appended
    assert miss.tree.tokens == [] and _units(ahead) == 0
    ext = ahead.extend([7, 1, 2], 8, 4)
    ctx += [7, 1, 2]
    assert (ext.step, ext.position, ext.predrafted) == (3, len(ctx), False)
    assert ext.tree == _fresh(ctx, 8, 4)
    assert ahead.session.context == ctx
    assert ahead.hits == 1 and ahead.steps == 4


class _Recording:
    """A DraftSession wrapper noting the context length of each draft; `delay_s` per draft."""

    def __init__(self, inner, delay_s: float = 0.0) -> None:
        self.inner, self.delay_s, self.drafted_at = inner, delay_s, []

    def draft(self, budget, depth, params, generator, exclude_root=(), branches=0):
        import time

        time.sleep(self.delay_s)
        self.drafted_at.append((len(self.inner.context), tuple(exclude_root)))
        return self.inner.draft(budget, depth, params, generator, exclude_root, branches)

    def commit(self, tokens, features=None):
        self.inner.commit(tokens, features)

    def rollback(self, num_tokens):
        self.inner.rollback(num_tokens)

    def close(self):
        self.inner.close()


class _Counting(ContextSession):
    """Proposes t + 1, t + 2, ... after token t (mod 50): every tree is full, any bonus goes."""

    def draft(self, budget, depth, params, generator, exclude_root=(), branches=0):
        def expand(_nodes, paths, counts):
            last = [p[-1] if p else self.context[-1] for p in paths]
            return [Children([(t + i) % 50 for i in range(1, c + 1)], [-float(i) for i in range(c)])
                    for t, c in zip(last, counts)]

        return grow_tree(expand, budget, depth, exclude_root, branches)


def test_predrafts_are_done_deepest_first() -> None:
    rec = _Recording(_Counting(list(range(14))))
    ahead = DraftAhead(rec, 14, GREEDY, pipelined=True, costs=eager(), fixed=True)
    st = ahead.first(4, 4)
    h = [st.tree.tokens[i] for i in main_path(st.tree)]
    assert len(h) == 4
    # every outcome, deepest first, each rooted after the accepted tokens and excluding what the
    # tree proposed there
    assert _units(ahead) == 5
    assert rec.drafted_at[1:] == [(18, ()), (17, (h[3],)), (16, (h[2],)), (15, (h[1],)), (14, (h[0],))]


def _commit_all(ahead: DraftAhead, steps: int, verify_s: float) -> None:
    """Commits at once of the whole main path with a bonus no predraft proposes (99), each
    reporting a verification of `verify_s`; predrafting whatever is planned in between."""
    st = ahead.first(4, 4)
    for step in range(steps):
        while ahead.predraft():
            pass
        h = [st.tree.tokens[i] for i in main_path(st.tree)]
        st = ahead.commit(step, h, 99, 4, 4, verify_s=verify_s)


def test_a_drafter_slower_than_the_verification_does_not_predraft() -> None:
    """Pipelining only where it is predicted to win: a predraft taking longer than the step it
    overlaps would only delay the misses, so once the costs are measured none is planned."""
    slow = DraftAhead(_Recording(_Counting(list(range(14))), delay_s=0.03), 14, GREEDY, pipelined=True)
    _commit_all(slow, 4, verify_s=0.001)
    assert slow.plan is not None and slow.plan.outcomes == () and not slow.wants_predraft
    fast = DraftAhead(_Recording(_Counting(list(range(14))), delay_s=0.001), 14, GREEDY, pipelined=True)
    _commit_all(fast, 4, verify_s=0.2)
    assert fast.plan.outcomes and fast.wants_predraft


def test_steps_slower_than_planned_beside_predrafts_turn_them_off() -> None:
    """Each commit's arrival, less the one before, is the period of the step it ends, measured
    against what the plan that chose the step predicted. Predrafting steps that come far slower
    than planned (what contention for shared cores does, unseen by the cost terms) while nothing
    was measured without them: predrafting stops."""
    ahead = DraftAhead(_Recording(_Counting(list(range(14))), delay_s=0.001), 14, GREEDY, pipelined=True,
                       costs=eager())
    st = ahead.first(4, 4)
    arrived = 0.0
    for step in range(3):
        assert ahead.plan.outcomes
        while ahead.predraft():
            pass
        arrived += 20.0  # against a planned step of about one verification, 0.2-1 s
        h = [st.tree.tokens[i] for i in main_path(st.tree)]
        st = ahead.commit(step, h, 99, 4, 4, arrived_at=arrived, verify_s=0.2)
    # not measured: the first step's period (from the open), and the second's, planned from the
    # priors (no verification was measured yet); the third's was
    assert ahead.costs.period_ratio(OVERLAPPED) > 5 and ahead.costs.period_ratio(SPECULATIVE) == 1.0
    assert ahead.plan.outcomes == () and not ahead.wants_predraft


def test_the_link_is_measured_to_the_commits_arrival() -> None:
    """A commit that waited for a predraft in progress arrived sooner than it is handled: the
    window is measured to its arrival, less the verification the verifier reports."""
    import time

    ahead = DraftAhead(_Recording(_Counting(list(range(14))), delay_s=0.05), 14, GREEDY, pipelined=True,
                       costs=eager(), fixed=True)
    st = ahead.first(4, 4)
    for step in range(6):
        arrived = time.perf_counter() + 0.03  # the commit comes 30 ms after the tree, 10 ms of it verifying
        while ahead.predraft():  # the drafter busy meanwhile: the commit waits in the queue
            pass
        h = [st.tree.tokens[i] for i in main_path(st.tree)]
        st = ahead.commit(step, h, 99, 4, 4, arrived_at=arrived, verify_s=0.01)
    assert 0.012 < ahead.costs.link_s < 0.025, ahead.costs.link_s
    c = ahead.costs  # verifications beside a predraft and alone are fitted apart; both saw 10 ms
    assert c.verify.samples + c.verify_overlapped.samples == 6
    for fit in (f for f in (c.verify, c.verify_overlapped) if f.samples):
        assert fit(1.0, 5.0) == pytest.approx(0.01, rel=0.05)


def test_each_verified_tree_counts_what_its_rates_expected_against_what_it_got() -> None:
    """Every tree sent counts, at its commit, the accepted tokens the session's rates expected of
    it when it went out against those the verifier accepted, in the session's acceptance and the
    drafter's recent sessions' (`Acceptance.tokens_calibration`: the plans' expected tokens scale
    by it); a plain run's empty tree counts nothing."""
    from specmesh.planner import expected_tokens, rates, shape_of

    ctx = list(CONTEXT)
    recent = Acceptance()
    ahead = DraftAhead(NgramDrafter().open(ctx), len(ctx), GREEDY, pipelined=False, costs=eager(), fixed=True,
                       recent=recent)
    st = ahead.first(8, 4)
    assert st.tree.tokens
    expected = expected_tokens(shape_of(st.tree.parents), rates(ahead.acceptance)) - 1.0
    before = ahead.acceptance.tokens_expected
    ahead.commit(0, [], 7, 8, 4)  # nothing accepted
    assert ahead.acceptance.tokens_expected - before == pytest.approx(expected) and expected > 0
    assert ahead.acceptance.tokens_seen == 0.0
    assert recent.tokens_expected == pytest.approx(expected) and recent.tokens_seen == 0.0
    assert ahead.acceptance.tokens_calibration < 1.0 and recent.tokens_calibration < 1.0
    empty = DraftAhead(NgramDrafter().open([1, 2, 3]), 3, GREEDY, pipelined=False, costs=eager(), fixed=True,
                       recent=Acceptance())
    st = empty.first(8, 4)
    assert not st.tree.tokens  # no n-gram match: an empty tree
    empty.commit(0, [], 4, 8, 4)
    assert empty.acceptance.tokens_expected == 0.0 and empty.recent.tokens_expected == 0.0


def test_draft_ahead_errors() -> None:
    ahead = DraftAhead(NgramDrafter().open(list(CONTEXT)), len(CONTEXT), GREEDY, pipelined=False)
    ahead.first(8, 4)
    assert not ahead.predraft(), "not pipelined: no predraft"
    with pytest.raises(ValueError, match="^step: expected 0"):
        ahead.commit(1, [], 1, 8, 4)
    ahead.close()
    with pytest.raises(SessionClosedError, match="^session_id:"):
        ahead.commit(0, [], 1, 8, 4)


# --- DraftAhead on a tiny random model: the KV cache stays right through predraft and rollback ---

@pytest.fixture(scope="module")
def tiny_model():
    """A random-initialised 2-layer Llama built directly on our runtime (no transformers import)."""
    from specmesh.model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      attention_bias=False, max_position_embeddings=256)
    torch.manual_seed(0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
    return Transformer(cfg, inv_freq).eval()


def test_a_turns_prompt_is_fed_apart_from_the_first_trees_draft(tiny_model, monkeypatch) -> None:
    """A model draft session feeds its committed tokens at its next draft call. The first tree of a
    turn would feed the whole prompt in the call that is timed as that tree's draft: a prefill
    priced as a draft made the planner's draft cost several times what drafting costs. The prompt
    is fed in a call of its own; the trees' timed calls feed nothing behind."""
    from specmesh.drafters.model import ModelDrafter

    timed = []
    add = DraftAhead._add_draft_cost
    monkeypatch.setattr(DraftAhead, "_add_draft_cost",
                        lambda self, trees, seconds, behind, many=False: timed.append(behind)
                        or add(self, trees, seconds, behind, many))
    ctx = list(range(3, 43))  # a 40-token prompt
    session = ModelDrafter(tiny_model).open(ctx)
    ahead = DraftAhead(session, len(ctx), GREEDY, pipelined=False, costs=eager(), fixed=True)
    tree = ahead.first(4, 2).tree
    assert tree.tokens and timed == [0]
    ahead.commit(0, [tree.tokens[0]], 7, 4, 2)  # a step's commit: the accepted node's K/V is kept
    assert timed == [0, 0]
    ahead.extend(list(range(10, 40)), 4, 2)  # a new turn: its 30 tokens fed apart too
    assert timed == [0, 0, 0]


def test_draft_ahead_model_matches_fresh_drafts(tiny_model) -> None:
    from specmesh.drafters.model import ModelDrafter

    drafter = ModelDrafter(tiny_model)

    def fresh(context, budget, depth):
        return drafter.open(list(context)).draft(budget, depth, GREEDY, make_generator(GREEDY))

    ctx = [3, 14, 15, 9, 26, 5]
    b, d, w = predraft_shape(8, 4)
    ahead = DraftAhead(drafter.open(ctx), len(ctx), GREEDY, pipelined=True, costs=eager(), fixed=True)
    st = ahead.first(8, 4)
    hits = 0
    for step in range(9):
        assert st.tree == fresh(ctx, 8, 4) or st.predrafted
        assert ahead.predraft()
        if step % 3:
            while ahead.predraft():  # the partial outcomes too
                pass
        path = [st.tree.tokens[i] for i in main_path(st.tree)]
        p = None
        if step % 3 == 0:  # accept the main path, bonus = the drafter's own next token (a hit)
            accepted = path
            p = drafter.open(ctx + accepted).draft(b, d, GREEDY, make_generator(GREEDY), (), w)
        elif step % 3 == 1:  # accept one token; the bonus is the best one the tree did not propose
            accepted = path[:1]
            below = [st.tree.tokens[c] for c in children_of(st.tree)[main_path(st.tree)[0]]]
            p = drafter.open(ctx + accepted).draft(b, d, GREEDY, make_generator(GREEDY), below, w)
        if p is not None:
            bonus = p.tokens[0]
            expected = pick_predrafted(p, bonus, 8, 4, useful_depth(4, GREEDY))  # None: too shallow
        else:  # a miss: accept one token, then a bonus of our own
            accepted, bonus, expected = path[:1], (step * 7) % 64, None
        st = ahead.commit(step, accepted, bonus, 8, 4)
        ctx += accepted + [bonus]
        assert st.position == len(ctx)
        hits += st.predrafted
        if p is not None:  # a hit exactly when the predraft has a deep enough tree under the bonus
            assert st.predrafted == (expected is not None) and (expected is None or st.tree == expected)
        if st.predrafted:  # the predrafted tree's best path is what a fresh draft proposes first
            assert st.tree.tokens[0] == fresh(ctx, 8, 4).tokens[0]
    assert hits >= 3


# --- Trees grown together (grow_trees, draft_many): the trees each would be alone, one expansion per level ---

def _scripted(seed: int):
    """A deterministic expand: children of a node depend on its tree's root and its path only."""
    def children(root: int, path: tuple[int, ...], count: int) -> Children:
        rng = np.random.default_rng([seed, root, *path])
        toks = rng.choice(40, size=count + 2, replace=False).tolist()[:count]
        return Children(toks, sorted(rng.uniform(-3, 0, size=count).tolist(), reverse=True))
    return children


@pytest.mark.parametrize("shapes", [
    [(8, 4, (), 0), (4, 4, (5,), 0), (16, 3, (), 0), (1, 1, (), 0)],
    [(2, 6, (), 0), (12, 2, (1, 2), 0)],
    [(0, 3, (), 0), (6, 3, (), 0)],  # an empty tree beside a full one
    [(10, 5, (), 2), (18, 5, (4,), 2), (8, 4, (), 0)],  # predraft shapes beside a plain tree
])
def test_grow_trees_grows_each_tree_as_alone_one_expansion_per_level(shapes) -> None:
    children = _scripted(7)
    calls = []

    def together(trees, nodes, paths, counts):
        calls.append(len(nodes))
        return [children(t, p, c) for t, p, c in zip(trees, paths, counts)]

    grown = grow_trees(together, shapes)
    for t, (budget, depth, exclude, branches) in enumerate(shapes):
        alone = grow_tree(lambda _n, paths, counts, t=t: [children(t, p, c) for p, c in zip(paths, counts)],
                          budget, depth, exclude, branches)
        assert grown[t] == alone
        assert not set(alone.tokens[i] for i in children_of(alone)[ROOT]) & set(exclude)
    deepest = max((max(depths(g.parents), default=0) for g in grown), default=0)
    assert len(calls) == deepest, "one expand call per level, for all trees"


@pytest.mark.parametrize("budget, depth, sub", [(10, 5, (4, 4)), (18, 5, (8, 4)), (7, 3, (2, 2)), (2, 4, (0, 0))])
def test_branches_give_each_root_child_a_tree_of_its_own(budget, depth, sub) -> None:
    """With `branches`, each root child gets the tree a fresh draft at it would get, of shape
    ((budget - branches) // branches, depth - 1): the second candidate's is not the leftovers."""
    children = _scripted(3)
    tree = grow_tree(lambda _n, paths, counts: [children(0, p, c) for p, c in zip(paths, counts)], budget, depth, (), 2)
    root_kids = children_of(tree)[ROOT]
    assert len(root_kids) == 2
    for c in root_kids:
        below = grow_tree(lambda _n, paths, counts, c=c: [children(0, (tree.tokens[c],) + p, n) for p, n in zip(paths, counts)],
                          *sub)
        got = subtree(tree, c)
        assert (got.tokens, got.parents) == (below.tokens, below.parents)
        assert len(got) == sub[0] and max(depths(got.parents), default=0) == sub[1]


def test_model_draft_many_matches_fresh_drafts_in_the_forwards_of_one(tiny_model) -> None:
    from specmesh.drafters.model import ModelDrafter

    drafter = ModelDrafter(tiny_model)
    ctx = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    roots, excludes = [10, 7, 6, 9], [(), (1, 2), (), (60,)]
    for params in (GREEDY, SAMPLE):
        session = drafter.open(ctx)
        session.draft(4, 4, params, make_generator(params))  # a cache already holding the context
        forwards = []
        hook = tiny_model.register_forward_hook(lambda *_: forwards.append(1))
        try:
            many = session.draft_many(roots, 8, 5, params, make_generator(params), excludes)
        finally:
            hook.remove()
        assert len(forwards) == 5, "one forward for the context, then one per level below the roots"
        assert session.context == ctx
        for r, ex, tree in zip(roots, excludes, many):
            validate_tree(tree, 64, 8, 5, need_q=not params.greedy)
            assert max(depths(tree.parents)) == 5 and len(tree) == 8
            if params.greedy:  # sampled trees differ in their draws, not in their shapes
                assert tree == drafter.open(ctx[:r]).draft(8, 5, params, make_generator(params), ex)
        # the session drafts on normally afterwards
        session.commit([4, 4])
        assert session.draft(6, 3, GREEDY, make_generator(GREEDY)) == \
            drafter.open(ctx + [4, 4]).draft(6, 3, GREEDY, make_generator(GREEDY))


def test_oracle_draft_many_costs_one_level_per_level() -> None:
    import time

    from specmesh.drafters import OracleDrafter

    ref = list(range(100, 140))
    oracle = OracleDrafter(ref, alpha=1.0, vocab_size=200, draft_cost_s=0.05)
    session = oracle.open(ref[:20])
    t = time.perf_counter()
    many = session.draft_many([20, 17, 15], 4, 4, GREEDY, make_generator(GREEDY), [(), (), ()])
    elapsed = time.perf_counter() - t
    assert [m.tokens for m in many] == [ref[20:24], ref[17:21], ref[15:19]]  # alpha 1: the reference
    assert 0.2 <= elapsed < 0.4, f"4 levels at 0.05 s each, whatever the number of trees: {elapsed:.3f} s"


def test_oracle_row_cost_makes_a_wider_level_cost_more() -> None:
    """The CPU-like cost model: each row of a level adds `draft_row_cost_s` to that level's sleep."""
    import time

    from specmesh.drafters import OracleDrafter

    ref = list(range(100, 140))
    oracle = OracleDrafter(ref, alpha=1.0, vocab_size=200, draft_cost_s=0.01, draft_row_cost_s=0.02)
    session = oracle.open(ref[:20])
    t = time.perf_counter()
    session.draft_many([20, 17, 15], 4, 4, GREEDY, make_generator(GREEDY), [(), (), ()])  # 3 chains: 3 rows a level
    elapsed = time.perf_counter() - t
    assert 4 * (0.01 + 3 * 0.02) <= elapsed < 4 * (0.01 + 3 * 0.02) + 0.15, f"{elapsed:.3f} s"


def test_draft_ahead_predrafts_every_outcome_in_one_unit_with_draft_many() -> None:
    pools = _Pools(0)
    ahead = DraftAhead(_MarkovManySession([0, 1, 2], pools), 3, GREEDY, pipelined=True, costs=eager(), fixed=True)
    st = ahead.first(4, 4)
    h = [st.tree.tokens[i] for i in main_path(st.tree)]
    assert _units(ahead) == 1 and ahead.predrafts == len(h) + 1
    # a hit on a partial outcome: the session held the whole main path and rolls back to it
    pred = ahead._predrafts[tuple(h[:1])].tree
    bonus = next(pred.tokens[c] for c in children_of(pred)[ROOT] if children_of(pred)[c])
    hit = ahead.commit(0, h[:1], bonus, 4, 4)
    assert hit.predrafted and ahead.session.context == [0, 1, 2, h[0], bonus]
    for step in range(1, 4):  # each step: one unit of work for every outcome
        assert _units(ahead) == 1 and len(ahead.take_fresh()) == len(main_path(hit.tree)) + 1
        h = [hit.tree.tokens[i] for i in main_path(hit.tree)]
        hit = ahead.commit(step, h, 0, 4, 4)


def test_fresh_predrafts_and_a_commit_that_took_one() -> None:
    """take_fresh hands out each predraft once, as made; commit(took=True) goes on from the tree
    the verifier picked from it, and refuses an outcome it has no such tree for."""
    ctx = list(CONTEXT)
    ahead = DraftAhead(NgramDrafter().open(ctx), len(ctx), GREEDY, pipelined=True, push=True, costs=eager(), fixed=True)
    st = ahead.first(8, 4)
    h = [st.tree.tokens[i] for i in main_path(st.tree)]
    _units(ahead)
    fresh = ahead.take_fresh()
    assert ahead.take_fresh() == []
    assert sorted(len(p.accepted) for p in fresh) == list(range(len(h) + 1))
    assert all(p.step == 0 and p.accepted == h[:len(p.accepted)] and p.position == len(ctx) + len(p.accepted)
               for p in fresh)
    full = next(p for p in fresh if p.accepted == h)
    bonus = full.tree.tokens[children_of(full.tree)[ROOT][0]]
    picked = pick_predrafted(full.tree, bonus, 8, 4, useful_depth(4, GREEDY))
    assert picked is not None
    with pytest.raises(ValueError, match="^took_predraft:"):
        ahead.commit(0, h, 10**6, 8, 4, took=True)  # a bonus no predraft proposes: nothing changes
    st = ahead.commit(0, h, bonus, 8, 4, took=True)
    assert (st.step, st.position, st.predrafted, st.tree) == (1, len(ctx) + len(h) + 1, True, picked)
    _units(ahead)
    assert {p.step for p in ahead.take_fresh()} == {1}


# --- Statistical losslessness through predrafted trees ---
#
# A Markov toy: the target's distribution after token x is TABLE[x], the drafter's Q_TABLE[x]
# (they differ everywhere). Each trial opens a session at [0] (first tree: 2 root children),
# verifies it, commits, and verifies the tree the session answers with, predrafted whenever the
# predraft matches. Two checks: the first three output tokens are distributed as the target's;
# and after a predraft hit with bonus b, the next tree's first output token is distributed as
# TABLE[b] (verification of a valid tree is exact given its context, whatever led there).

V = 5


def _table(seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * scale, dim=-1)  # [V, V]


TABLE = _table(21, 1.0)
Q_TABLE = 0.5 * TABLE + 0.5 * _table(22, 3.0)  # close enough to the target for frequent hits


class _Pools:
    """I.i.d. draws from Q_TABLE rows, drawn in bulk (per-token torch calls would dominate)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.pools: dict[int, list[int]] = {x: [] for x in range(V)}
        self.sparse = {x: (list(range(V)), Q_TABLE[x].tolist()) for x in range(V)}

    def draw(self, x: int, count: int) -> list[int]:
        pool = self.pools[x]
        if len(pool) < count:
            pool += torch.multinomial(Q_TABLE[x], 4096, replacement=True, generator=self.generator).tolist()
        return [pool.pop() for _ in range(count)]


class _MarkovSession:
    """A DraftSession drafting from Q_TABLE[last token] with grow_tree (children i.i.d. from q)."""

    def __init__(self, context: list[int], pools: _Pools) -> None:
        self.context = list(context)
        self.pools = pools

    def commit(self, tokens: list[int], features=None) -> None:
        self.context.extend(tokens)

    def rollback(self, num_tokens: int) -> None:
        del self.context[num_tokens:]

    def close(self) -> None:
        pass

    def children(self, x: int, count: int) -> Children:
        kids = self.pools.draw(x, count)
        ids, probs = self.pools.sparse[x]
        return Children(kids, [float(np.log(probs[k])) for k in kids], ids, probs)

    def draft(self, budget, depth, params, generator, exclude_root=(), branches=0) -> DraftTree:
        def expand(_nodes, paths, counts) -> list[Children]:
            return [self.children(p[-1] if p else self.context[-1], c) for p, c in zip(paths, counts)]

        return grow_tree(expand, budget, depth, exclude_root, branches)


class _MarkovManySession(_MarkovSession):
    """The same drafter, predrafting every outcome at once (`draft_many`, `grow_trees`)."""

    def draft_many(self, roots, budget, depth, params, generator, excludes, branches=0) -> list[DraftTree]:
        def expand(trees, _nodes, paths, counts) -> list[Children]:
            return [self.children(p[-1] if p else self.context[roots[t] - 1], c)
                    for t, p, c in zip(trees, paths, counts)]

        return grow_trees(expand, [(budget, depth, ex, branches) for ex in excludes])


def _target_rows(context_last: int, tree: DraftTree) -> torch.Tensor:
    return torch.cat([TABLE[[context_last]], TABLE[tree.tokens]]) if tree.tokens else TABLE[[context_last]]


TRIALS = 3000


def _run(trials: int, seed: int, session=_MarkovSession) -> tuple[np.ndarray, np.ndarray]:
    """Counts [V, V, V] of the first three output tokens, and [V, V] of (bonus b, next token)
    over the trials whose second tree was predrafted."""
    verifier = torch.Generator().manual_seed(seed + 1)
    pools = _Pools(seed)
    counts = np.zeros((V,) * 3, dtype=np.int64)
    after_hit = np.zeros((V, V), dtype=np.int64)
    recent = Acceptance()  # shared: each trial's plan follows the earlier trials' outcomes
    for _ in range(trials):
        ahead = DraftAhead(session([0], pools), 1, SAMPLE, pipelined=True, costs=eager(), recent=recent)
        st, out = ahead.first(2, 1), []
        for step in range(2):
            while ahead.predraft():  # both outcomes: the main path accepted, or nothing
                pass
            new = verify_sampling(st.tree, _target_rows(([0] + out)[-1], st.tree), verifier).tokens(st.tree)
            if step == 0:
                st = ahead.commit(0, new[:-1], new[-1], 2, 1)
            elif st.predrafted:
                after_hit[out[-1], new[0]] += 1
            out += new
        while len(out) < 3:
            out.append(sample_token(TABLE[out[-1]], verifier))
        counts[tuple(out[:3])] += 1
    return counts, after_hit


def _p_value(counts: np.ndarray, probs: np.ndarray, ddof: int = 0) -> float:
    """Chi-square p-value that counts come from probs (cells expected < 5 times pooled)."""
    counts, probs = counts.ravel(), probs.ravel()
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp, ddof=min(ddof, len(obs) - 2)).pvalue)


def _p_values(counts: np.ndarray, after_hit: np.ndarray) -> tuple[float, float]:
    t = TABLE.numpy()
    first3 = t[0][:, None, None] * t[:, :, None] * t[None, :, :]  # [V, V, V]
    given_bonus = after_hit.sum(axis=1, keepdims=True) * t  # [V, V]: n_b * TABLE[b, y]
    return _p_value(counts, first3), _p_value(after_hit, given_bonus, ddof=V - 1)


@pytest.fixture(scope="module")
def lossless_run() -> tuple[np.ndarray, np.ndarray]:
    return _run(TRIALS, seed=1)


@pytest.mark.parametrize("session", [_MarkovSession, _MarkovManySession], ids=["one-by-one", "all-at-once"])
def test_output_through_predrafted_trees_is_target_distribution(session, lossless_run) -> None:
    counts, after_hit = lossless_run if session is _MarkovSession else _run(TRIALS, seed=2, session=session)
    assert after_hit.sum() > TRIALS // 20, f"too few predraft hits ({after_hit.sum()}) to mean anything"
    assert min(_p_values(counts, after_hit)) > 1e-3


def test_statistical_test_catches_a_wrong_q_after_rerooting(monkeypatch: pytest.MonkeyPatch) -> None:
    real = pick.subtree

    def stale_q(tree: DraftTree, node: int) -> DraftTree:
        sub = real(tree, node)  # keeps the predraft root's q: wrong for the new root's children
        return DraftTree(sub.tokens, sub.parents, [ROOT], [tree.q_ids[0]], [tree.q_probs[0]]) if sub.tokens else sub

    monkeypatch.setattr(pick, "subtree", stale_q)
    counts, after_hit = _run(TRIALS, seed=1)
    assert _p_values(counts, after_hit)[1] < 1e-6


def _plain_prone(tiny_model, pipelined: bool, first_trees: bool = True):
    """A session under costs where the verifier's one-row step beats every tree (a level of
    drafting takes a second), with evidence that half the drafted tokens are accepted (its
    drafter's recent sessions, and as many trees of its own as a session drafts before it may go
    plain, unless not `first_trees`): (ahead, costs, recent, context)."""
    from specmesh.drafters.model import ModelDrafter

    costs = Costs(draft=LinearCost((1.0, 0.1, 0.01, 0.0)), verify=LinearCost((0.01, 0.01)))
    recent = Acceptance()
    recent.tried[0][0], recent.accepted[0][0] = 100.0, 50.0
    ctx = [3, 14, 15, 9, 26, 5]
    ahead = DraftAhead(ModelDrafter(tiny_model).open(ctx), len(ctx), GREEDY, pipelined=pipelined, costs=costs,
                       recent=recent)
    return _past_its_first_trees(ahead, 0.5) if first_trees else ahead, costs, recent, ctx


def _past_its_first_trees(ahead: DraftAhead, rate: float) -> DraftAhead:
    """`ahead` with the trees of its own that a session drafts before it may go plain (whatever
    its prior says) verified, a `rate` of their first nodes accepted."""
    own = predraft.MIN_TRIALS - int(predraft.PRIOR_OBSERVATIONS)
    for i in range(own):
        ahead.acceptance.observe([-1], [0] if i < round(rate * own) else [])
    return ahead


@pytest.mark.parametrize("pipelined", [True, False])
def test_no_tree_when_speculation_cannot_pay_then_a_probe(tiny_model, pipelined: bool) -> None:
    """Costs under which the verifier's one-row step beats every tree (a level of drafting takes
    a second), with evidence that half the drafted tokens are accepted: the drafter sends an empty
    tree that asks for a run of PROBE_EVERY one-row steps, whose tokens come back in one
    extension; then one tree (the acceptance is only learnt from verified trees), then a run
    again, twice as long (the probe did not make trees win), up to MAX_PROBE_EVERY. A tree
    planned on its merits sets the gap back. Pipelined, the drafter feeds the committed tokens
    while the verifier steps (nothing is left for the probe to catch up on); sequential, the
    probe's draft feeds them."""
    from specmesh.drafters.model import ModelDrafter

    ahead, costs, recent, ctx = _plain_prone(tiny_model, pipelined)
    st = ahead.first(8, 4)
    assert not st.tree.tokens and st.plain == predraft.PROBE_EVERY
    assert ahead.wants_predraft == (pipelined and ahead.session.behind > 0)
    while ahead.predraft():
        pass
    assert ahead.session.behind == (0 if pipelined else len(ctx) - 1)
    probe = ahead.extend([7] * st.plain, 8, 4)  # the run's tokens, in one message
    assert probe.step == st.step + 1 and probe.tree.tokens and probe.plain == 0
    assert ahead.session.behind == 0  # the probe fed what was left
    again = ahead.commit(probe.step, [], 7, 8, 4)
    assert not again.tree.tokens and again.plain == 2 * predraft.PROBE_EVERY
    # a verifier that commits the empty tree's step alone instead: a probe follows at once
    probe = ahead.commit(again.step, [], 7, 8, 4)
    assert probe.tree.tokens
    runs = []
    for _ in range(4):
        run = ahead.commit(probe.step, [], 7, 8, 4)
        runs.append(run.plain)
        probe = ahead.extend([7] * run.plain, 8, 4, same_turn=True)
        assert probe.tree.tokens
    assert runs == [4 * predraft.PROBE_EVERY, predraft.MAX_PROBE_EVERY, predraft.MAX_PROBE_EVERY,
                    predraft.MAX_PROBE_EVERY]
    # drafting turns cheap and drafted tokens are accepted: trees win on their merits
    costs.draft = LinearCost((1e-4, 0.0, 0.0, 0.0))
    ahead.acceptance.accepted[0][0] = ahead.acceptance.tried[0][0]
    assert ahead.commit(probe.step, [], 7, 8, 4).tree.tokens
    costs.draft = LinearCost((1.0, 0.1, 0.01, 0.0))  # and costly again
    assert ahead.commit(probe.step + 1, [], 7, 8, 4).plain == predraft.PROBE_EVERY
    # a fixed shape always gets its tree
    fixed = DraftAhead(ModelDrafter(tiny_model).open(ctx), len(ctx), GREEDY, pipelined=pipelined, costs=costs,
                       recent=recent, fixed=True)
    assert len(fixed.first(8, 4).tree) == 8


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_session_drafts_trees_of_its_own_before_its_prior_can_make_it_plain(tiny_model, pipelined: bool) -> None:
    """Its drafter's recent sessions, at the costs of this session, make plain steps win; a new
    session still drafts trees until its acceptance holds MIN_TRIALS depth-1 trials, the prior's
    PRIOR_OBSERVATIONS included (acceptance differs between prompts far more than within one: a
    session that went plain on its prior learnt its own acceptance only from rare probes, and the
    Qwen2.5-Coder pair ran a whole prompt plain at 0.65 where its trees were accepted at 0.93)."""
    from specmesh import planner

    ahead, costs, _recent, _ctx = _plain_prone(tiny_model, pipelined, first_trees=False)
    assert planner.plan(costs, ahead.acceptance, 8, 4, pipelined, True, plain_run=8).budget == 0  # the prior's verdict
    st, trees = ahead.first(8, 4), 0
    while st.tree.tokens:
        trees += 1
        assert sum(ahead.acceptance.tried[0]) < predraft.MIN_TRIALS
        st = ahead.commit(st.step, [], 7, 8, 4)  # none accepted
    assert trees >= 1 and sum(ahead.acceptance.tried[0]) >= predraft.MIN_TRIALS and st.plain > 0


def test_a_drafter_serving_several_sessions_plans_their_drafting_in_turn(tiny_model) -> None:
    """Costs under which a tree pays for one session (a level of drafting ~ a tenth of the
    verifier's step, half the drafted tokens accepted) but not once the drafter drafts for 8
    sessions in turn: the same session then asks for a run of plain steps, probing 8 times less
    often (each probe's drafting delays every session)."""
    from specmesh.drafters.model import ModelDrafter

    recent = Acceptance()
    recent.tried[0][0], recent.accepted[0][0] = 100.0, 80.0
    ctx = [3, 14, 15, 9, 26, 5]
    sessions = [1]

    def ahead():  # costs of its own: a drafted tree's measured time would rescale them
        costs = Costs(draft=LinearCost((0.01, 0.001, 0.0001, 0.0)), verify=LinearCost((0.1, 0.01)))
        return DraftAhead(ModelDrafter(tiny_model).open(ctx), len(ctx), GREEDY, pipelined=False, costs=costs,
                          recent=recent, sharing=lambda: sessions[0])

    assert _past_its_first_trees(ahead(), 0.8).first(8, 4).tree.tokens
    sessions[0] = 8
    st = _past_its_first_trees(ahead(), 0.8).first(8, 4)
    assert not st.tree.tokens and st.plain == 8 * predraft.PROBE_EVERY


def test_calibration_prices_fed_tokens_apart_and_leaves_the_session_as_it_was(tiny_model) -> None:
    """`calibrate` times trees after committed tokens too (the catch-up term of the draft cost)
    and rolls them back: the session it was given holds the same context afterwards, and a
    tree drafted from it equals one from a fresh session."""
    from specmesh.drafters.model import ModelDrafter
    from specmesh.drafters.predraft import calibrate

    ctx = [3, 14, 15, 9, 26, 5, 35, 8]
    session, costs = ModelDrafter(tiny_model).open(ctx), Costs()
    calibrate(session, ctx, costs, rounds=1)
    assert costs.draft.calibrated and costs.draft_many.calibrated
    assert all(c >= 0 for c in costs.draft.coef + costs.draft_many.coef)
    assert session.context == ctx
    gen = make_generator(GREEDY)
    fresh = ModelDrafter(tiny_model).open(ctx).draft(6, 3, GREEDY, gen)
    again = session.draft(6, 3, GREEDY, gen)
    assert (again.tokens, again.parents) == (fresh.tokens, fresh.parents)


def test_calibration_feeds_committed_tokens_it_never_drafted(tiny_model) -> None:
    """The catch-up samples commit tokens that were never drafted, as a run of plain steps does, so
    the session really feeds them before its tree: the fed term is measured over the range live
    calls use (up to PROBE_EVERY tokens), not left at zero by reused drafted K/V."""
    from specmesh.drafters.model import ModelDrafter
    from specmesh.drafters.predraft import CALIBRATION_FED, PROBE_EVERY, calibrate

    ctx = [3, 14, 15, 9, 26, 5, 35, 8]
    session = ModelDrafter(tiny_model).open(ctx)
    seen: list[int] = []
    draft = session.draft

    def recording(*args, **kwargs):
        seen.append(session.behind)
        return draft(*args, **kwargs)

    session.draft = recording
    calibrate(session, ctx, Costs(), rounds=1)
    assert max(CALIBRATION_FED) >= PROBE_EVERY
    assert max(seen) >= max(CALIBRATION_FED) - 1  # the last committed token stays pending
    assert session.context == ctx


@pytest.mark.parametrize("fixed", [True, False])
def test_a_planned_tree_that_comes_out_empty_is_not_a_plain_run(fixed: bool) -> None:
    """The n-gram drafter finds no candidate after most tokens: the planned tree comes out empty,
    and the verifier takes one step and asks again. Only a plan for no tree asks for a run of plain
    steps (a seeded request, whose fixed shapes keep its samples independent of timing and of the
    drafter's history, must never get one; a probe's empty tree is no evidence against trees)."""
    ctx = [5, 6, 7, 5, 6]
    costs = Costs(draft=LinearCost((1e-5, 0.0, 0.0, 0.0)), verify=LinearCost((0.01, 1e-4)))
    ahead = DraftAhead(NgramDrafter().open(ctx), len(ctx), GREEDY, pipelined=False, costs=costs, fixed=fixed)
    st = ahead.first(4, 4)
    assert st.tree.tokens  # 7 follows 5, 6
    for bonus in range(100, 112):  # tokens never seen: no candidate after them
        st = ahead.commit(st.step, [], bonus, 4, 4)
        assert not st.tree.tokens and st.plain == 0


def test_a_turns_first_window_and_one_outlier_leave_the_link_as_measured() -> None:
    """The first tree of a turn goes out before the verifier prefills the turn's tokens: its window
    holds that prefill and is no link sample. The link is the median of recent windows (less the
    verification): one window that held something else (a pause of the host) does not move it."""
    import time

    ahead = DraftAhead(_Counting(list(range(14))), 14, GREEDY, pipelined=False, costs=eager(), fixed=True)
    st = ahead.first(4, 4)

    def commit(step: int, window: float):
        h = [st.tree.tokens[i] for i in main_path(st.tree)]
        return ahead.commit(step, h, 99, 4, 4, arrived_at=time.perf_counter() + window, verify_s=0.01)

    st = commit(0, 1.0)  # the turn's first: a second of prefill in its window
    assert ahead.costs.link_s == Costs().link_s
    for step in range(1, 6):
        st = commit(step, 0.03)
    assert 0.015 < ahead.costs.link_s < 0.025, ahead.costs.link_s
    st = commit(6, 2.0)  # a window that held something else
    assert 0.015 < ahead.costs.link_s < 0.025, ahead.costs.link_s
    samples = len(ahead.costs._links)
    st = ahead.extend([5, 6, 7], 4, 4)  # a new turn: its first window holds its prefill
    st = commit(8, 3.0)
    assert len(ahead.costs._links) == samples
    st = commit(9, 0.03)
    assert len(ahead.costs._links) == samples + 1 and 0.015 < ahead.costs.link_s < 0.025


def test_a_plain_runs_tokens_are_fed_in_its_own_period(tiny_model, monkeypatch) -> None:
    """A plain run's tokens come back in one extension. The drafter feeds them then, in a call of
    their own, counted in the run's period (the run's plan priced feeding them): the probe tree
    after it is drafted by a call that feeds nothing behind, as its plan priced it."""
    import time

    from specmesh.costs import PLAIN

    timed = []
    add = DraftAhead._add_draft_cost
    monkeypatch.setattr(DraftAhead, "_add_draft_cost",
                        lambda self, trees, seconds, behind, many=False: timed.append(behind)
                        or add(self, trees, seconds, behind, many))
    ahead = _plain_prone(tiny_model, pipelined=False)[0]
    st = ahead.first(8, 4)
    assert not st.tree.tokens
    probe = ahead.extend([7] * st.plain, 8, 4, same_turn=True)
    assert probe.tree.tokens and timed == [0]
    run = ahead.commit(probe.step, [], 7, 8, 4, arrived_at=100.0, verify_s=0.01)
    assert not run.tree.tokens
    slept = []
    draft, predictions = ahead.session.draft, ahead.session.predictions

    def slow_feed(budget, depth, *args, **kwargs):
        if budget == 0 and ahead.session.behind:
            slept.append(ahead.session.behind)
            time.sleep(0.05)
        return draft(budget, depth, *args, **kwargs)

    def slow_predictions(first):  # a greedy session's feed of a run: scored as it is fed
        slept.append(ahead.session.behind)
        time.sleep(0.05)
        return predictions(first)

    monkeypatch.setattr(ahead.session, "draft", slow_feed)
    monkeypatch.setattr(ahead.session, "predictions", slow_predictions)
    probe = ahead.extend([7] * run.plain, 8, 4, same_turn=True, arrived_at=101.0)
    assert probe.tree.tokens and timed == [0, 0] and slept == [run.plain]
    measured, predicted, n = ahead.costs._periods[PLAIN]
    assert n == 1 and measured >= 1.05


def _greedy_continuation(tiny_model, context: list[int], n: int) -> list[int]:
    """The tiny model's own greedy choices after `context`, one token at a time."""
    from specmesh.drafters.model import ModelDrafter

    s = ModelDrafter(tiny_model).open(list(context))
    out = []
    for _ in range(n):
        out.append(s.draft(1, 1, GREEDY, make_generator(GREEDY)).tokens[0])
        s.commit([out[-1]])
    return out


@pytest.mark.parametrize("agree", [True, False])
def test_a_greedy_plain_runs_tokens_are_evidence_of_acceptance(tiny_model, agree: bool) -> None:
    """A session planned plain learns its acceptance between probes: as the drafter feeds a plain
    run's tokens, it scores its own greedy choice at each of the last EVIDENCE_ROWS of them, taken
    as the chains it would have drafted there (as deep as the depth cap). Tokens that are the
    drafter's own choices count as chains accepted to the cap, the next starting after the bonus
    (a chain cut off by the run's end counts what was seen); tokens it never chooses count as a
    rejection at depth 1 each. A sampled session's feed is not scored."""
    ahead = _plain_prone(tiny_model, pipelined=False)[0]
    st = ahead.first(8, 4)
    probe = ahead.extend([7] * st.plain, 8, 4, same_turn=True)  # the turn's first run: fed by the probe's draft
    run = ahead.commit(probe.step, [], 7, 8, 4)
    assert run.plain >= predraft.EVIDENCE_ROWS
    own = _greedy_continuation(tiny_model, ahead.session.context, run.plain)
    tokens = own if agree else [(t + 1) % tiny_model.config.vocab_size for t in own]
    if not agree:  # each token differs from the drafter's choice after the same prefix
        assert all(t not in _greedy_continuation(tiny_model, ahead.session.context + tokens[:i], 1)
                   for i, t in enumerate(tokens))
    tried = [row[0] for row in ahead.acceptance.tried]
    accepted = [row[0] for row in ahead.acceptance.accepted]
    recent_tried = ahead.recent.tried[0][0]
    ahead.extend(tokens, 8, 4, same_turn=True)
    d_tried = [a - b for a, b in zip((row[0] for row in ahead.acceptance.tried), tried)]
    d_accepted = [a - b for a, b in zip((row[0] for row in ahead.acceptance.accepted), accepted)]
    n = predraft.EVIDENCE_ROWS  # 8 with the depth cap 4: a chain of 4 accepted, the bonus, then 3 cut off
    if agree:
        assert d_tried[:5] == [2, 2, 2, 1, 0] and d_accepted[:5] == [2, 2, 2, 1, 0]
    else:
        assert d_tried[:2] == [n, 0] and d_accepted[:2] == [0, 0]
    assert ahead.recent.tried[0][0] - recent_tried == d_tried[0]  # the drafter's recent sessions learn it too
    assert ahead.session.behind == 0
    # sampled: the feed only feeds
    from specmesh.drafters.model import ModelDrafter

    sampled = SamplingParams(temperature=0.8, seed=1)
    costs = Costs(draft=LinearCost((1.0, 0.1, 0.01, 0.0)), verify=LinearCost((0.01, 0.01)))
    other = _past_its_first_trees(DraftAhead(ModelDrafter(tiny_model).open([3, 14, 15]), 3, sampled, pipelined=False,
                                             costs=costs, recent=Acceptance()), 0.5)
    st = other.first(8, 4)
    probe = other.extend([7] * st.plain, 8, 4, same_turn=True)
    run = other.commit(probe.step, [], 7, 8, 4)
    before = sum(other.acceptance.tried[0])
    other.extend([7] * run.plain, 8, 4, same_turn=True)
    assert sum(other.acceptance.tried[0]) == before



def test_a_scored_draft_is_the_draft_plus_the_drafters_own_choices_from_its_feed(tiny_model) -> None:
    """`draft_scored` drafts the tree `draft` drafts, and from the same forward over the fed tokens
    gives the drafter's greedy choice for each committed token from `first` on (what
    `predictions` gives): one forward for the feed, none more."""
    from specmesh.drafters.model import ModelDrafter

    drafter = ModelDrafter(tiny_model)
    ctx = [3, 14, 15, 9, 26, 5, 35, 8]
    for first in (6, 7):
        session = drafter.open(ctx[:5])
        session.draft(3, 3, GREEDY, make_generator(GREEDY))  # the cache holds 4 of the 5 tokens
        session.commit(ctx[5:])
        forwards = []
        hook = tiny_model.register_forward_hook(lambda *_: forwards.append(1))
        try:
            tree, choices = session.draft_scored(first, 4, 3, GREEDY, make_generator(GREEDY))
        finally:
            hook.remove()
        assert len(forwards) == 3, "one forward for the feed and the root, then one per level below"
        assert tree == drafter.open(ctx).draft(4, 3, GREEDY, make_generator(GREEDY))
        reference = drafter.open(ctx[:5])
        reference.draft(1, 1, GREEDY, make_generator(GREEDY))
        reference.commit(ctx[5:])
        assert choices == reference.predictions(first)[:-1] and len(choices) == len(ctx) - first
        assert choices == _greedy_choices(tiny_model, ctx, first)


def _greedy_choices(tiny_model, ctx: list[int], first: int) -> list[int]:
    """The tiny model's greedy choice for each of ctx[first:], given the tokens before it."""
    return [_greedy_continuation(tiny_model, ctx[:i], 1)[0] for i in range(first, len(ctx))]


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("agree", [True, False])
def test_a_bonus_below_an_accepted_leaf_is_a_trial_one_level_deeper(tiny_model, pipelined: bool, agree: bool) -> None:
    """A greedy session whose trees stay shallow still learns the acceptance of the levels below
    them: when the accepted path ends at a leaf, the bonus sits where a deeper tree's next node
    would have, and the drafter's own choice there against it is that node's trial. Pipelined, the
    predraft for that outcome holds the choice (its first bonus candidate); taking turns, the next
    draft scores it from the feed it makes anyway. No trial where the path ends above a leaf, nor
    in a sampled session."""
    from specmesh.drafters.model import ModelDrafter

    ctx = [3, 14, 15, 9, 26, 5]
    recent = Acceptance()
    ahead = DraftAhead(ModelDrafter(tiny_model).open(list(ctx)), len(ctx), GREEDY, pipelined=pipelined,
                       costs=eager(), recent=recent, fixed=True)
    st = ahead.first(1, 1)  # one-node trees: depth 2 is never drafted
    for step in range(3):
        if pipelined:
            while ahead.predraft():
                pass
        node = st.tree.tokens[0]
        own = _greedy_continuation(tiny_model, ahead.session.context[:ahead.position] + [node], 1)[0]
        bonus = own if agree else (own + 1) % tiny_model.config.vocab_size
        tried, accepted = ahead.acceptance.tried[1][0], ahead.acceptance.accepted[1][0]
        recent_tried = recent.tried[1][0]
        st = ahead.commit(step, [node], bonus, 1, 1)
        assert ahead.acceptance.tried[1][0] == tried + 1 and recent.tried[1][0] == recent_tried + 1
        assert ahead.acceptance.accepted[1][0] == accepted + agree
    # the path ends above a leaf (its node's children all rejected): nothing below is known
    tree_ahead = DraftAhead(ModelDrafter(tiny_model).open(list(ctx)), len(ctx), GREEDY, pipelined=pipelined,
                            costs=eager(), fixed=True)
    st = tree_ahead.first(4, 2)
    path = [st.tree.tokens[i] for i in main_path(st.tree)]
    assert len(path) == 2
    before = [row[:] for row in tree_ahead.acceptance.tried]
    tree_ahead.commit(0, path[:1], 63 if path[1] != 63 else 62, 4, 2)
    assert tree_ahead.acceptance.tried[2] == before[2]
    # sampled: no trial beyond the tree
    sampled = DraftAhead(ModelDrafter(tiny_model).open(list(ctx)), len(ctx), SAMPLE, pipelined=pipelined,
                         costs=eager(), fixed=True)
    st = sampled.first(1, 1)
    sampled.commit(0, [st.tree.tokens[0]], 7, 1, 1)
    assert sum(sampled.acceptance.tried[1]) == 0
