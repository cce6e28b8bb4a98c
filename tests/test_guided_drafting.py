"""Drafting under a grammar (`drafters.base.TreeGuide`): the drafter grows only nodes the grammar
allows, drawn from its q renormalised over the allowed tokens, and sampled output stays exactly
the masked target's (chi-square against the exact masked Markov target, the same test catching a
guide that reports the drafter's unrenormalised q); acceptance rises over unguided drafting.
The grammar here is a rule over the previous token (a stand-in with an exact reference);
`test_grammar.py` runs the llguidance guide on the bundled model."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from specmesh.drafters import base
from specmesh.drafters.base import Children, DraftGuide, TreeGuide, children_from_probs, grow_tree
from specmesh.sampling import SamplingParams, sample_token, verify_sampling
from specmesh.tree import ROOT
from tests.test_sampling import P_ROOT, Q_ROOT, Q_TABLE, TABLE, V, _p_value

SAMPLED = SamplingParams(temperature=1.0)
FORBIDDEN_AT_START = (1, 3)  # Q_ROOT puts 0.55 on them


def allowed_after(prev: int | None) -> torch.Tensor:
    """[V] bool: the rule's tokens after `prev` (None: the first output token)."""
    ok = torch.ones(V, dtype=torch.bool)
    if prev is None:
        ok[list(FORBIDDEN_AT_START)] = False
    else:
        ok[(prev + 3) % V] = False
        ok[(prev + 4) % V] = False
    return ok


class RuleGuide:
    """A guide over a one-token context: the turn's output begins at position 1."""

    def __init__(self) -> None:
        self.asked = 0

    def allowed(self, seq: list[int]) -> torch.Tensor:
        self.asked += 1
        return allowed_after(seq[-1] if seq else None)


def masked(p: torch.Tensor, prev: int | None) -> torch.Tensor:
    out = p.clone()
    out[~allowed_after(prev)] = 0
    return out / out.sum()


def draft(guided: bool, budget: int, depth: int, params: SamplingParams, generator: torch.Generator,
          whole_q: bool = True):
    """`whole_q`: the drafter hands the guide its whole distribution (model drafters), else only
    its sparse q (n-gram, oracle): the guide then redraws from q over the allowed tokens."""
    def expand(_nodes, paths, counts) -> list[Children]:
        kids = [children_from_probs((Q_ROOT if not path else Q_TABLE[path[-1]]).float(), c, params, generator)
                for path, c in zip(paths, counts)]
        return kids if whole_q else [replace(k, probs=None) for k in kids]

    guide = TreeGuide(DraftGuide(params, 1, RuleGuide()), [0], [1], generator) if guided else None
    return grow_tree(expand, budget, depth, guide=guide)


def run(guided: bool, budget: int, depth: int, trials: int, length: int, seed: int, whole_q: bool = True):
    """Counts [V]*length of the first `length` output tokens, and accepted draft tokens per step."""
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros((V,) * length, dtype=np.int64)
    accepted = 0
    for _ in range(trials):
        tree = draft(guided, budget, depth, SAMPLED, generator, whole_q)
        rows = torch.stack([masked(P_ROOT, None)] + [masked(TABLE[t], t) for t in tree.tokens])  # [N+1, V]
        result = verify_sampling(tree, rows, generator)
        accepted += len(result.accepted)
        out = result.tokens(tree)
        while len(out) < length:
            out.append(sample_token(masked(TABLE[out[-1]], out[-1]), generator))
        counts[tuple(out[:length])] += 1
    return counts, accepted / trials


def seq_probs(length: int) -> np.ndarray:
    """Exact probability [V]*length of the first `length` tokens under the masked target."""
    probs = masked(P_ROOT, None).numpy()
    for _ in range(length - 1):
        table = torch.stack([masked(TABLE[x], x) for x in range(V)]).numpy()  # [V, V]
        probs = probs[..., None] * table.reshape((1,) * (probs.ndim - 1) + (V, V))
    return probs


def p_values(counts: np.ndarray) -> list[float]:
    return [_p_value(counts.sum(axis=tuple(range(k, counts.ndim))), seq_probs(k)) for k in range(1, counts.ndim + 1)]


def test_guided_trees_hold_only_allowed_nodes_and_report_the_renormalised_q():
    generator = torch.Generator().manual_seed(0)
    for params, whole_q in [(p, w) for p in (SamplingParams(), SAMPLED) for w in (True, False)]:
        for _ in range(200):
            tree = draft(True, 6, 3, params, generator, whole_q)
            assert tree.tokens, "the drafter always has allowed tokens here"
            for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents)):
                prev = None if parent == ROOT else tree.tokens[parent]
                assert allowed_after(prev)[tok], (tree, i)
            for node, ids, probs in zip(tree.q_nodes, tree.q_ids, tree.q_probs):
                prev = None if node == ROOT else tree.tokens[node]
                q = (Q_ROOT if prev is None else Q_TABLE[prev]).clone()
                q[~allowed_after(prev)] = 0
                want = {t: float(v) for t, v in enumerate(q / q.sum()) if v > 0}
                assert dict(zip(ids, probs)) == pytest.approx(want)


def test_a_tree_rooted_before_the_turns_output_is_not_shaped():
    """The drafter's context may lag the turn's start (a predraft rooted before it): no grammar
    state is known there, so its children stay the drafter's own and the grammar is not asked."""
    generator = torch.Generator().manual_seed(0)
    rule = RuleGuide()
    kids = children_from_probs(Q_ROOT.float(), 3, SAMPLED, generator)
    guide = TreeGuide(DraftGuide(SAMPLED, 2, rule), [0, 5], [1], generator)  # output begins at 2
    assert guide.prune(0, (), kids, 3) is kids and rule.asked == 0
    shaped = TreeGuide(DraftGuide(SAMPLED, 1, rule), [0, 5], [1], generator).prune(0, (), kids, 3)
    assert rule.asked == 1 and not set(shaped.tokens) & set(FORBIDDEN_AT_START)


def test_greedy_guided_trees_keep_the_drafters_likeliest_allowed_tokens():
    q = Q_ROOT.clone()
    q[~allowed_after(None)] = -1
    for whole_q in (True, False):
        tree = draft(True, 3, 1, SamplingParams(), torch.Generator(), whole_q)
        assert tree.tokens == q.argsort(descending=True)[:3].tolist()


@pytest.mark.parametrize("whole_q", [True, False], ids=["whole-q", "sparse-q"])
@pytest.mark.parametrize("budget, depth, length", [pytest.param(3, 3, 3, id="chain3"),
                                                   pytest.param(6, 2, 2, id="wide6x2")])
def test_guided_sampling_is_the_masked_target_distribution(budget, depth, length, whole_q):
    counts, _ = run(True, budget, depth, 20_000, length, seed=3, whole_q=whole_q)
    assert min(p_values(counts)) > 1e-3, p_values(counts)


def test_the_statistical_test_catches_a_guide_reporting_the_drafters_own_q(monkeypatch):
    real = TreeGuide.prune

    def unrenormalised(self, tree, path, kids, count):
        out = real(self, tree, path, kids, count)
        if kids.q_ids is None or not out.tokens:
            return out
        return Children(out.tokens, out.logprobs, kids.q_ids, kids.q_probs)  # drawn from q', reported as q

    monkeypatch.setattr(base.TreeGuide, "prune", unrenormalised)
    counts, _ = run(True, 3, 3, 8_000, 3, seed=3)
    assert min(p_values(counts)) < 1e-6


def test_guiding_raises_acceptance():
    _, unguided = run(False, 3, 3, 4_000, 1, seed=5)
    _, guided = run(True, 3, 3, 4_000, 1, seed=5)
    assert guided > unguided + 0.2, (guided, unguided)
