"""Sampling and verification: turn target logits over a draft tree into accepted tokens + a bonus.

This module defines *the target distribution* specmesh reproduces (`target_probs`: temperature,
then top-k, then top-p) and checks a `DraftTree` against it in one of two ways:

- greedy (`verify_greedy`): walk from the root, accepting a child whose token is the target's
  argmax; output is token-for-token what target-only greedy decoding produces.
- sampling (`verify_sampling`): recursive rejection sampling over siblings (SpecInfer / SpecTr
  with i.i.d. candidates): a child c of a node with target distribution p and proposal q is
  accepted with probability min(1, p[c] / q[c]); after a rejection p becomes the residual
  norm(max(0, p - q)) and the next sibling is tried. The output distribution equals the target's.

Every step yields at least one token: the accepted path (possibly empty) plus one bonus token.

What it does not know: models, KV caches, transport, sessions. It trusts that the tree passed
`validate_tree(..., need_q=True)` and that the drafter really drew each node's children i.i.d.
from the q it reported (a drafter that lies about q can bias sampled output; the verifier cannot
detect that from one tree). Randomness comes only from the `torch.Generator` passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specmesh.tree import ROOT, DraftTree, children_of

MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20
MAX_SEED = 1 << 63  # exclusive
# Residual mass below this means p == q: a rejection (probability ~0) leaves p unchanged.
RESIDUAL_EPS = 1e-12


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = 0  # 0 = off, else >= 1
    seed: int | None = None  # None = non-deterministic

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError, message starting with the field name, if any field is bad."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature: must be >= 0 and finite, got {t!r}")
        if t > MAX_TEMPERATURE:
            raise ValueError(f"temperature: must be <= {MAX_TEMPERATURE:g}, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {p!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_K:
            raise ValueError(f"top_k: must be an int in [0, {MAX_TOP_K}] (0 = off), got {k!r}")
        s = self.seed
        bad_seed = isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < MAX_SEED
        if s is not None and bad_seed:
            raise ValueError(f"seed: must be an int in [0, 2**63) or None, got {s!r}")


def make_generator(params: SamplingParams) -> torch.Generator:
    """CPU generator seeded by `params.seed`, or non-deterministically when it is None."""
    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution per row: temperature, then top-k, then top-p, renormalised.

    logits: [T, V]; returns float64 [T, V], rows summing to 1. Not for greedy (temperature 0).
    Ties at the top-k or top-p cut are all kept, so the result never depends on sort order.
    """
    assert logits.dim() == 2, f"logits must be [T, V], got {tuple(logits.shape)}"
    assert not params.greedy, "target_probs is for sampling; greedy uses argmax of the logits"
    x = logits.to(torch.float64)  # [T, V]
    # Subtract the row max before dividing, so tiny temperatures give -inf, never nan.
    x = (x - x.max(dim=-1, keepdim=True).values) / params.temperature  # [T, V]
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]  # [T, 1]
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, dim=-1)  # [T, V]
    if params.top_p < 1.0:
        sorted_probs = torch.sort(probs, dim=-1, descending=True).values  # [T, V]
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [T, V]
        # Smallest prefix reaching top_p: tokens whose preceding mass is still below it.
        # The first token always qualifies (mass_before 0 < top_p).
        keep = mass_before < params.top_p  # [T, V]
        n_keep = keep.sum(dim=-1, keepdim=True)  # [T, 1]
        cutoff = sorted_probs.gather(-1, n_keep - 1)  # [T, 1], smallest kept probability
        probs = probs.masked_fill(probs < cutoff, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample from after rejecting a draw from q. p, q: [V].

    When p == q (residual mass ~0) a rejection has probability ~0; return p.
    """
    diff = torch.clamp(p - q, min=0.0)  # [V]
    mass = float(diff.sum())
    if mass <= RESIDUAL_EPS:
        return p
    return diff / mass


def sparse_to_dense(ids: list[int], probs: list[float], vocab_size: int) -> torch.Tensor:
    """Dense float64 [V] q from sparse ids/probs, renormalised (validation allows 1e-3 slack)."""
    dense = torch.zeros(vocab_size, dtype=torch.float64)  # [V]
    dense[torch.tensor(ids, dtype=torch.long)] = torch.tensor(probs, dtype=torch.float64)
    return dense / dense.sum()


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id drawn from probs [V] (need not be normalised)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


@dataclass(frozen=True)
class VerifyResult:
    accepted: list[int]  # node indices of the accepted path, root side first
    bonus: int  # token id sampled (or argmax'd) from the target after the path

    def tokens(self, tree: DraftTree) -> list[int]:
        """The new tokens this step produced: accepted tokens, then the bonus."""
        return [tree.tokens[i] for i in self.accepted] + [self.bonus]


def _check_rows(tree: DraftTree, rows: torch.Tensor) -> None:
    assert rows.dim() == 2 and rows.shape[0] == len(tree) + 1, (
        f"need one row per node plus the root: [{len(tree) + 1}, V], got {tuple(rows.shape)}"
    )


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
    """Accept the longest path whose tokens are the target's argmax; the bonus is the next argmax.

    logits: [N+1, V]; row 0 follows the last committed token, row i+1 follows node i.
    """
    _check_rows(tree, logits)
    best = logits.argmax(dim=-1).tolist()  # [N+1], first index on ties
    kids = children_of(tree)
    accepted: list[int] = []
    node = ROOT
    while True:
        want = best[node + 1]
        nxt = next((c for c in kids[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return VerifyResult(accepted=accepted, bonus=want)
        accepted.append(nxt)
        node = nxt


def verify_sampling(
    tree: DraftTree, probs: torch.Tensor, generator: torch.Generator
) -> VerifyResult:
    """Recursive rejection sampling over the tree; the output is distributed as the target.

    probs: [N+1, V] target distributions (rows of `target_probs`), row 0 for the root's children,
    row i+1 for node i's children. Children of a node must be i.i.d. draws from its q.
    """
    _check_rows(tree, probs)
    vocab_size = probs.shape[-1]
    probs = probs.to(torch.float64)  # [N+1, V]
    kids = children_of(tree)
    q_index = {node: j for j, node in enumerate(tree.q_nodes)}
    accepted: list[int] = []
    node = ROOT
    while True:
        p = probs[node + 1]  # [V]
        children = kids[node]
        if not children:
            return VerifyResult(accepted=accepted, bonus=sample_token(p, generator))
        assert node in q_index, f"node {node} has children but no q (tree not validated?)"
        j = q_index[node]
        q = sparse_to_dense(tree.q_ids[j], tree.q_probs[j], vocab_size)  # [V]
        nxt = None
        for c in children:
            token = tree.tokens[c]
            q_c = float(q[token])
            assert q_c > 0.0, f"node {c}: token {token} has zero draft probability"
            r = float(torch.rand((), generator=generator, dtype=torch.float64))
            if r < min(1.0, float(p[token]) / q_c):
                nxt = c
                break
            p = residual_distribution(p, q)
        if nxt is None:
            return VerifyResult(accepted=accepted, bonus=sample_token(p, generator))
        accepted.append(nxt)
        node = nxt


def verify_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
) -> VerifyResult:
    """Verify a tree against target logits [N+1, V] under `params` (greedy or sampling)."""
    if params.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, target_probs(logits, params), generator)
