"""Tests for specmesh.sampling: params, the target distribution, greedy and lossless verification.

The statistical tests draft trees the way a drafter must (children i.i.d. from the q it reports),
verify them against a fixed target, and check with a chi-square test that the output tokens are
distributed exactly as the target's, alone and in pairs/triples. Power tests swap in a wrong
residual and check the same test then fails: a statistical test that cannot fail is a defect.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy import stats

from specmesh import sampling
from specmesh.sampling import (
    SamplingParams,
    VerifyResult,
    make_generator,
    residual_distribution,
    sample_token,
    sparse_to_dense,
    target_probs,
    verify_greedy,
    verify_sampling,
    verify_tree,
)
from specmesh.tree import ROOT, DraftTree, children_of, validate_tree



@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: on a busy small machine, intra-op thread sync costs milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_p": float("nan")}, "top_p"),
        ({"temperature": 1.0, "top_p": -0.5}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"temperature": 1.0, "top_k": (1 << 20) + 1}, "top_k"),
        ({"temperature": 1.0, "top_k": 2.5}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 1 << 63}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
    ],
)
def test_sampling_params_rejects(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs).validate()
    assert str(info.value).startswith(f"{field}:"), str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "seed": 0},
        {"temperature": 1, "top_p": 1.0, "top_k": 1, "seed": (1 << 63) - 1},
        {"temperature": 100.0, "top_p": 1e-6, "top_k": 1 << 20},
    ],
)
def test_sampling_params_accepts(kwargs: dict) -> None:
    SamplingParams(**kwargs).validate()


def test_greedy_flag() -> None:
    assert SamplingParams().greedy
    assert SamplingParams(top_k=1, top_p=0.5).greedy
    assert not SamplingParams(temperature=0.1).greedy


def test_make_generator_seeded_and_unseeded() -> None:
    a = make_generator(SamplingParams(temperature=1.0, seed=7))
    b = make_generator(SamplingParams(temperature=1.0, seed=7))
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    c = make_generator(SamplingParams(temperature=1.0))
    d = make_generator(SamplingParams(temperature=1.0))
    assert c.initial_seed() != d.initial_seed()


# ---------------------------------------------------------------------------------------------
# target_probs and small helpers


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float64).log()  # [1, V]


SQRT_SUM = sum(math.sqrt(p) for p in (0.1, 0.2, 0.3, 0.4))


@pytest.mark.parametrize(
    "temperature, expected",
    [
        (1.0, [0.1, 0.2, 0.3, 0.4]),
        (0.5, [0.01 / 0.3, 0.04 / 0.3, 0.09 / 0.3, 0.16 / 0.3]),  # probs squared
        (2.0, [math.sqrt(p) / SQRT_SUM for p in (0.1, 0.2, 0.3, 0.4)]),  # square roots
    ],
)
def test_target_probs_temperature(temperature: float, expected: list[float]) -> None:
    got = target_probs(_logits([0.1, 0.2, 0.3, 0.4]), SamplingParams(temperature=temperature))
    torch.testing.assert_close(got, torch.tensor([expected], dtype=torch.float64))


@pytest.mark.parametrize(
    "top_k, expected",
    [
        (1, [0, 0, 0, 1]),
        (2, [0, 0, 3 / 7, 4 / 7]),
        (4, [0.1, 0.2, 0.3, 0.4]),
        (9, [0.1, 0.2, 0.3, 0.4]),  # k > V: no-op
    ],
)
def test_target_probs_top_k(top_k: int, expected: list[float]) -> None:
    got = target_probs(_logits([0.1, 0.2, 0.3, 0.4]), SamplingParams(temperature=1.0, top_k=top_k))
    torch.testing.assert_close(got, torch.tensor([expected], dtype=torch.float64))


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.4, [1, 0, 0, 0]),
        (0.7, [0.625, 0.375, 0, 0]),
        (0.9, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        (1.0, [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_target_probs_top_p(top_p: float, expected: list[float]) -> None:
    # Vocabulary order shuffled so the test does not rely on sorted input.
    perm = [2, 0, 3, 1]
    probs = [[0.5, 0.3, 0.15, 0.05][i] for i in perm]
    got = target_probs(_logits(probs), SamplingParams(temperature=1.0, top_p=top_p))
    want = torch.tensor([[expected[i] for i in perm]], dtype=torch.float64)
    torch.testing.assert_close(got, want)


def test_target_probs_top_k_before_top_p() -> None:
    # top-k 2 -> [0.625, 0.375]; top-p 0.6 then keeps one. (top-p first would keep two.)
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.6)
    got = target_probs(_logits([0.5, 0.3, 0.15, 0.05]), params)
    torch.testing.assert_close(got, torch.tensor([[1.0, 0, 0, 0]], dtype=torch.float64))


def test_target_probs_keeps_ties_at_the_cut() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    got = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(got, torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0]], dtype=torch.float64))
    got = target_probs(torch.zeros(1, 4), SamplingParams(temperature=1.0, top_p=0.3))
    torch.testing.assert_close(got, torch.full((1, 4), 0.25, dtype=torch.float64))


def test_target_probs_extremes() -> None:
    logits = torch.tensor([[3.0, -float("inf"), 2.0, 1000.0], [0.0, 0.0, 5.0, -float("inf")]])
    got = target_probs(logits, SamplingParams(temperature=1e-6))
    want = torch.tensor([[0, 0, 0, 1.0], [0, 0, 1.0, 0]], dtype=torch.float64)
    torch.testing.assert_close(got, want)
    got = target_probs(logits, SamplingParams(temperature=100.0))
    assert got[0, 1] == 0 and got[1, 3] == 0 and torch.isfinite(got).all()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.3, top_k=5),
        SamplingParams(temperature=1.7, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.5),
    ],
)
def test_target_probs_rows_sum_to_one(params: SamplingParams) -> None:
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(3)) * 3  # [7, 50]
    got = target_probs(logits, params)
    assert got.shape == (7, 50)
    torch.testing.assert_close(got.sum(-1), torch.ones(7, dtype=torch.float64))
    assert (got >= 0).all()
    if params.top_k:
        assert ((got > 0).sum(-1) <= params.top_k).all()


@pytest.mark.parametrize(
    "p, q, expected",
    [
        ([0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [1.0, 0, 0]),
        ([0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.4 / 0.6, 0.2 / 0.6, 0]),
        ([0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2]),  # p == q: p itself
        ([0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]),
    ],
)
def test_residual_distribution(p: list[float], q: list[float], expected: list[float]) -> None:
    f64 = torch.float64
    got = residual_distribution(torch.tensor(p, dtype=f64), torch.tensor(q, dtype=f64))
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))


def test_sparse_to_dense() -> None:
    got = sparse_to_dense([3, 1], [0.25, 0.75], 5)
    torch.testing.assert_close(got, torch.tensor([0, 0.75, 0, 0.25, 0], dtype=torch.float64))


def test_sample_token_never_draws_zero_probability() -> None:
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0], dtype=torch.float64)
    drawn = {sample_token(probs, g) for _ in range(500)}
    assert drawn == {1, 3}
    assert sample_token(torch.tensor([0.0, 0.0, 1.0]), g) == 2
    assert sample_token(torch.tensor([1.0, 0.0, 0.0]), g) == 0


def test_sample_token_at_the_top_of_the_draw_takes_the_last_token_with_mass(monkeypatch) -> None:
    """A uniform draw times the total can round up to the total: the token drawn is then the last
    with mass, never a zero-probability one after it."""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    assert sample_token(torch.tensor([0.3, 0.7, 0.0, 0.0], dtype=torch.float64), g) == 1


def test_sample_token_draws_the_distribution() -> None:
    """Frequencies of 20000 draws, unnormalised input with zeros at both ends and in between:
    chi-square against the normalised probabilities (p-value above 1e-3)."""
    from scipy import stats

    g = torch.Generator().manual_seed(1)
    weights = torch.tensor([0.0, 2.0, 0.5, 0.0, 1.0, 0.25, 4.0, 0.0], dtype=torch.float64)
    counts = torch.bincount(torch.tensor([sample_token(weights, g) for _ in range(20000)]), minlength=8)
    assert counts[weights == 0].sum() == 0
    keep = weights > 0
    expected = weights[keep] / weights.sum() * 20000
    assert stats.chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue > 1e-3


# ---------------------------------------------------------------------------------------------
# Greedy verification

GV = 5  # vocabulary of the greedy literal cases


def _argmax_logits(best: list[int]) -> torch.Tensor:
    """Logits [len(best), GV] whose row i has its maximum at best[i]."""
    logits = torch.zeros(len(best), GV)
    logits[torch.arange(len(best)), torch.tensor(best)] = 1.0
    return logits


@pytest.mark.parametrize(
    "tokens, parents, best, accepted, out",
    [
        # Chain fully accepted: bonus is the argmax after the last node.
        ([1, 2, 3], [-1, 0, 1], [1, 2, 3, 4], [0, 1, 2], [1, 2, 3, 4]),
        # Mismatch at depth 2: the target wants 0 after token 1.
        ([1, 2, 3], [-1, 0, 1], [1, 0, 3, 4], [0], [1, 0]),
        # Mismatch at depth 1: plain decoding.
        ([1, 2, 3], [-1, 0, 1], [4, 2, 3, 4], [], [4]),
        # The second root child matches, then its second child.
        ([1, 2, 3, 4], [-1, -1, 1, 1], [2, 0, 4, 0, 0], [1, 3], [2, 4, 0]),
        # Empty tree: the bonus from row 0.
        ([], [], [3], [], [3]),
        # Duplicate siblings: the first in tree order wins, even when only the second's
        # subtree would have matched further.
        ([3, 3, 1, 2], [-1, -1, 0, 1], [3, 2, 0, 0, 0], [0], [3, 2]),
    ],
)
def test_verify_greedy_literal(
    tokens: list[int], parents: list[int], best: list[int], accepted: list[int], out: list[int]
) -> None:
    tree = DraftTree(tokens=tokens, parents=parents)
    result = verify_greedy(tree, _argmax_logits(best))
    assert result == VerifyResult(accepted=accepted, bonus=out[-1])
    assert result.tokens(tree) == out


def test_verify_greedy_ties_take_lowest_id() -> None:
    tree = DraftTree.chain([2])
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    assert verify_greedy(tree, logits).tokens(tree) == [1]


def test_verify_tree_dispatch() -> None:
    tree = DraftTree([1, 2, 3], [-1, -1, 0], [ROOT, 0], [[1, 2], [3, 4]], [[0.5, 0.5], [0.5, 0.5]])
    logits = _argmax_logits([2, 3, 0, 1]) * 4  # [4, GV]
    g = torch.Generator().manual_seed(0)
    greedy = verify_tree(tree, logits, SamplingParams(), g)
    assert greedy == VerifyResult(accepted=[1], bonus=0)
    # top_k=1 makes the target one-hot, so sampling must agree with greedy on every draw.
    one_hot = SamplingParams(temperature=1.0, top_k=1)
    assert all(verify_tree(tree, logits, one_hot, g) == greedy for _ in range(50))


# ---------------------------------------------------------------------------------------------
# Statistical losslessness
#
# Target: the distribution after committed token x is TABLE[x] (a Markov target), and after the
# last committed token it is P_ROOT. Draft: children of the root are i.i.d. from a root q, children
# of a node with token x i.i.d. from Q_TABLE[x]. Every q differs from its p, with tokens where
# q > p, q < p, q > 0 = p and p > 0 = q (the last can only come out of a residual).

V = 6
P_ROOT = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.00], dtype=torch.float64)
Q_ROOT = torch.tensor([0.10, 0.40, 0.00, 0.15, 0.05, 0.30], dtype=torch.float64)
Q_PEAKED = torch.tensor([0.02, 0.80, 0.00, 0.08, 0.00, 0.10], dtype=torch.float64)  # duplicates


def _table(seed: int, zero_shift: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=g, dtype=torch.float64) * 0.8  # [V, V]
    table = torch.softmax(logits, dim=-1)  # [V, V]
    rows = torch.arange(V)
    table[rows, (rows + zero_shift) % V] = 0.0
    return table / table.sum(-1, keepdim=True)


TABLE = _table(seed=11, zero_shift=1)  # [V, V] target p after token x; p[x+1] = 0
Q_TABLE = _table(seed=12, zero_shift=2)  # [V, V] draft q after token x; q[x+2] = 0

# Tree shapes: parents in tree order. Children counts never depend on the drawn tokens.
CHAIN3 = [-1, 0, 1]
WIDE = [-1, -1, -1, 0, 0, 1, 1, 2, 2]  # 3 root children with 2 children each
DUPS = [-1, -1, -1, -1, 0, 1, 2, 3]  # 4 root children from a peaked q, one child each


class _Drafter:
    """Draws tokens i.i.d. from the q it reports, from pre-drawn pools (one per distribution)."""

    def __init__(self, seed: int, root_q: torch.Tensor) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.root_q = root_q
        self.pools: dict[int, list[int]] = {}
        self.sparse: dict[int, tuple[list[int], list[float]]] = {}
        for token in [ROOT, *range(V)]:
            q = self.q(token)
            ids = q.nonzero().flatten().tolist()
            self.sparse[token] = ids, q[ids].tolist()

    def q(self, token: int) -> torch.Tensor:
        return self.root_q if token == ROOT else Q_TABLE[token]

    def draw(self, token: int) -> int:
        pool = self.pools.get(token)
        if not pool:
            q, g = self.q(token), self.generator
            pool = torch.multinomial(q, 4096, replacement=True, generator=g).tolist()
            self.pools[token] = pool
        return pool.pop()

    def tree(self, parents: list[int]) -> DraftTree:
        tokens: list[int] = []
        for p in parents:
            tokens.append(self.draw(ROOT if p == ROOT else tokens[p]))
        expanded = sorted(set(parents))  # ROOT first
        sparse = [self.sparse[ROOT if node == ROOT else tokens[node]] for node in expanded]
        q_ids = [ids for ids, _ in sparse]
        q_probs = [probs for _, probs in sparse]
        return DraftTree(tokens, list(parents), expanded, q_ids, q_probs)


def _target_rows(tree: DraftTree) -> torch.Tensor:
    return torch.cat([P_ROOT[None], TABLE[tree.tokens]])  # [N+1, V]


def _run(
    parents: list[int], root_q: torch.Tensor, trials: int, length: int, seed: int
) -> np.ndarray:
    """Counts [V]*length of the first `length` output tokens over `trials` verification steps.

    When a step yields fewer tokens, the rest are sampled from the target, as the next plain
    decoding step (empty tree) would.
    """
    drafter = _Drafter(seed, root_q)
    generator = torch.Generator().manual_seed(seed + 1)
    counts = np.zeros((V,) * length, dtype=np.int64)
    for _ in range(trials):
        tree = drafter.tree(parents)
        out = verify_sampling(tree, _target_rows(tree), generator).tokens(tree)
        while len(out) < length:
            out.append(sample_token(TABLE[out[-1]], generator))
        counts[tuple(out[:length])] += 1
    return counts


def _seq_probs(length: int) -> np.ndarray:
    """Target probability [V]*length of each possible sequence of the first `length` tokens."""
    probs = P_ROOT.numpy()  # [V]
    table = TABLE.numpy()  # [V, V]
    for _ in range(length - 1):
        # P(x_1..x_k, y) = P(x_1..x_k) * table[x_k, y]
        probs = probs[..., None] * table.reshape((1,) * (probs.ndim - 1) + (V, V))
    return probs


def _p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value that counts come from probs. 0 if an impossible outcome occurred.

    Cells expected fewer than 5 times are pooled into one, as the chi-square test needs.
    """
    counts, probs = counts.ravel(), probs.ravel()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp).pvalue)


def _p_values(counts: np.ndarray) -> list[float]:
    """p-values for the first token, the first two, ... the first `counts.ndim` tokens."""
    out = []
    for k in range(1, counts.ndim + 1):
        marginal = counts.sum(axis=tuple(range(k, counts.ndim)))
        out.append(_p_value(marginal, _seq_probs(k)))
    return out


@pytest.mark.parametrize(
    "parents, root_q, trials, length",
    [
        pytest.param(CHAIN3, Q_ROOT, 20_000, 3, id="chain3"),
        pytest.param(WIDE, Q_ROOT, 20_000, 2, id="wide3x2"),
        pytest.param(DUPS, Q_PEAKED, 20_000, 2, id="duplicates"),
    ],
)
def test_sampling_output_is_target_distribution(
    parents: list[int], root_q: torch.Tensor, trials: int, length: int
) -> None:
    counts = _run(parents, root_q, trials, length, seed=1)
    impossible = counts.ravel()[_seq_probs(length).ravel() == 0].sum()
    assert impossible == 0, "emitted a token the target gives probability 0"
    p_values = _p_values(counts)
    assert min(p_values) > 1e-3, p_values


def test_drafted_trees_are_valid_and_duplicates_occur() -> None:
    drafter = _Drafter(1, Q_PEAKED)
    trees = [drafter.tree(DUPS) for _ in range(200)]
    for tree in trees:
        validate_tree(tree, vocab_size=V, max_nodes=len(DUPS), need_q=True)
    with_dups = sum(len(set(t.tokens[:4])) < 4 for t in trees)
    assert with_dups > 150


Residual = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _residual_unchanged(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p  # forgets to remove the rejected mass


def _residual_reversed(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    diff = torch.clamp(q - p, min=0.0)  # p and q swapped
    return diff / diff.sum()


def _residual_unnormalised(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.clamp(p - q, min=0.0)  # right support, wrong scale for the next acceptance test


@pytest.mark.parametrize(
    "bad_residual", [_residual_unchanged, _residual_reversed, _residual_unnormalised]
)
def test_statistical_test_catches_wrong_residual(
    monkeypatch: pytest.MonkeyPatch, bad_residual: Residual
) -> None:
    monkeypatch.setattr(sampling, "residual_distribution", bad_residual)
    counts = _run(WIDE, Q_ROOT, 5_000, 2, seed=1)
    assert min(_p_values(counts)) < 1e-6


# ---------------------------------------------------------------------------------------------
# Properties over random trees


def _random_case(rng: random.Random, vocab: int) -> tuple[DraftTree, torch.Tensor]:
    """A random tree with honest-looking sparse q that covers every child, and logits [N+1, V]."""
    n = rng.randint(0, 12)
    parents = [rng.randint(-1, i - 1) for i in range(n)]
    tokens = [rng.randrange(vocab) for _ in range(n)]
    kids = children_of(DraftTree(tokens, parents))
    q_nodes, q_ids, q_probs = [], [], []
    for node in [ROOT, *range(n)]:
        if not kids[node]:
            continue
        ids = sorted({tokens[c] for c in kids[node]} | set(rng.sample(range(vocab), 2)))
        weights = [rng.random() + 0.01 for _ in ids]
        q_nodes.append(node)
        q_ids.append(ids)
        q_probs.append([w / sum(weights) for w in weights])
    tree = DraftTree(tokens, parents, q_nodes, q_ids, q_probs)
    validate_tree(tree, vocab_size=vocab, max_nodes=16, need_q=True)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = torch.randn(n + 1, vocab, generator=g) * 2  # [N+1, V]
    return tree, logits


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0),
    ],
)
def test_every_step_yields_tokens_on_an_accepted_path(params: SamplingParams) -> None:
    rng = random.Random(5)
    vocab = 8
    generator = torch.Generator().manual_seed(5)
    for _ in range(300):
        tree, logits = _random_case(rng, vocab)
        result = verify_tree(tree, logits, params, generator)
        out = result.tokens(tree)
        assert len(out) == len(result.accepted) + 1 >= 1
        assert 0 <= result.bonus < vocab
        # The accepted nodes form a path from the root.
        rows = [ROOT, *result.accepted]
        assert all(tree.parents[c] == p for p, c in zip(rows, rows[1:]))
        # Every output token is one the target could produce in its context.
        contexts = [r + 1 for r in rows]  # row index of each output token's distribution
        if params.greedy:
            best = logits.argmax(-1)
            assert out == [int(best[r]) for r in contexts]
        else:
            probs = target_probs(logits, params)
            assert all(probs[r, t] > 0 for r, t in zip(contexts, out))


def test_seeded_verification_is_reproducible() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    rng = random.Random(9)
    cases = [_random_case(rng, 8) for _ in range(100)]

    def run(p: SamplingParams) -> list[VerifyResult]:
        generator = make_generator(p)
        return [verify_tree(tree, logits, p, generator) for tree, logits in cases]

    first = run(params)
    assert run(params) == first
    assert run(SamplingParams(temperature=0.9, top_p=0.95, seed=4321)) != first


def test_explicit_zero_is_not_read_as_unset_on_the_wire():
    """top_p, repetition_penalty and seed carry explicit presence: unset is the default, an explicit
    0 reaches the validator (top_p 0, repetition_penalty 0: refused; seed 0: a seed)."""
    from specmesh.client import build_request
    from specmesh.convert import sampling_from_pb, sampling_to_pb
    from specmesh.v1 import common_pb2

    unset = sampling_from_pb(common_pb2.SamplingParams(temperature=1.0))
    assert (unset.top_p, unset.repetition_penalty, unset.seed) == (1.0, 1.0, None)
    for field in ("top_p", "repetition_penalty"):
        with pytest.raises(ValueError, match=field):
            sampling_from_pb(common_pb2.SamplingParams(temperature=1.0, **{field: 0.0})).validate()
    assert sampling_from_pb(common_pb2.SamplingParams(seed=0)).seed == 0
    req = build_request([1, 2, 3], temperature=1.0, top_p=0.0)  # the SDK sends what it was given
    assert req.sampling.HasField("top_p") and req.sampling.top_p == 0.0
    with pytest.raises(ValueError, match="top_p"):
        sampling_from_pb(req.sampling).validate()
    p = SamplingParams(temperature=0.5, top_p=0.25, repetition_penalty=1.5, seed=7)
    assert sampling_from_pb(sampling_to_pb(p)) == p
