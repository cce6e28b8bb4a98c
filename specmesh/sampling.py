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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specmesh.logprobs import TokenLogprob
from specmesh.tree import ROOT, DraftTree, children_of, path_to

MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20
MAX_SEED = 1 << 63  # exclusive
# Residual mass below this means p == q: a rejection (probability ~0) leaves p unchanged.
RESIDUAL_EPS = 1e-12


MAX_PENALTY = 2.0  # presence / frequency, as OpenAI bounds them
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0  # per token, as OpenAI bounds it
MAX_LOGIT_BIAS_TOKENS = 1024


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = 0  # 0 = off, else >= 1
    seed: int | None = None  # None = non-deterministic
    # penalties (`Penalizer`): part of the target distribution, greedy or sampled
    presence_penalty: float = 0.0  # minus this from the logit of a token already in the turn's output
    frequency_penalty: float = 0.0  # minus this times its count in the turn's output
    repetition_penalty: float = 1.0  # a token in the context or output: logit / this (> 0) or * this (< 0)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending
    min_tokens: int = 0  # stop ids (EOS included) masked until the turn's output has this many tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
                raise ValueError(f"{name}: must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
        r = self.repetition_penalty
        if not (isinstance(r, (int, float)) and math.isfinite(r) and 0 < r <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty: must be in (0, {MAX_REPETITION_PENALTY:g}], got {r!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias: token {token}: bias must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias!r}")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"min_tokens: must be an int >= 0, got {m!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """logit_bias names tokens of the vocabulary."""
        bad = next((t for t, _ in self.logit_bias if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} outside vocabulary [0, {vocab_size})")


class Penalizer:
    """A turn's penalties (SamplingParams) applied to the target's logits of one step's rows.

    Each row of a tree's forward continues its own path: row 0 the committed tokens, row i + 1
    also node i and its ancestors. A row's counts are the turn's output so far plus its path, so
    every node is verified against the distribution target-only decoding would have used there,
    and output stays lossless with respect to the penalised target. Order, as in vLLM: repetition
    (context and output tokens), frequency and presence (output tokens), logit_bias, min_tokens
    (the stop ids masked while the output is shorter). Logprobs stay raw (taken before this)."""

    def __init__(self, params: SamplingParams, vocab_size: int, context: list[int], stop_ids: frozenset[int],
                 output: int = 0) -> None:
        """`context`: the committed tokens, whose last `output` are the turn's output already (a
        turn resumed after a failover)."""
        self.p = params
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)  # [V] of the turn's output so far
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V] context and output
        self.seen[torch.tensor(context, dtype=torch.long)] = True
        self.produced = 0
        self._seen_idx: torch.Tensor | None = None
        self.bias = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size, dtype=torch.float32)
            ids, values = zip(*params.logit_bias)
            self.bias[torch.tensor(ids)] = torch.tensor(values, dtype=torch.float32)
        self.stops = torch.tensor(sorted(stop_ids), dtype=torch.long)
        if output:
            self.add(context[len(context) - output:])

    def add(self, tokens: list[int]) -> None:
        """Tokens the turn emitted (in order)."""
        t = torch.tensor(tokens, dtype=torch.long)
        self.counts.index_add_(0, t, torch.ones(len(tokens)))
        self.seen[t] = True
        self.produced += len(tokens)
        self._seen_idx = None

    def _seen_ids(self) -> torch.Tensor:
        """[K] the ids of `seen` (cached until the next `add`)."""
        if self._seen_idx is None:
            self._seen_idx = self.seen.nonzero()[:, 0]
        return self._seen_idx

    def _penalise(self, x: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Repetition, frequency and presence on logits `x` with these counts / seen flags (same shape)."""
        p = self.p
        if p.repetition_penalty != 1.0:
            x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if p.frequency_penalty:
            x = x - p.frequency_penalty * counts
        if p.presence_penalty:
            x = x - p.presence_penalty * (counts > 0).to(x.dtype)
        return x

    def __call__(self, logits: torch.Tensor, parents: list[int], tokens: list[int]) -> torch.Tensor:
        """Penalised float32 logits [N+1, V] of a tree (parents, tokens) whose rows are `logits`."""
        paths = [[]] + [[tokens[j] for j in path_to(parents, i)] for i in range(len(parents))]
        return self.after(logits, paths)

    def after(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """Penalised float32 logits [R, V] of rows that each continue the turn's output so far with
        their own tokens `paths[r]` (a tree's rows; a drafter's nodes)."""
        raw = logits.to(torch.float32)
        x = raw.clone()
        seen = self._seen_ids()  # the committed part: only seen tokens carry these penalties
        if len(seen):
            cols = raw[:, seen]
            x[:, seen] = self._penalise(cols, self.counts[seen].expand_as(cols), torch.ones_like(cols, dtype=torch.bool))
        # each row's own path: recompute its tokens' entries with the path's counts added
        rows, cols, extra = [], [], []
        for i, path in enumerate(paths):
            for tok, n in Counter(path).items():
                rows.append(i), cols.append(tok), extra.append(n)
        if rows:
            r, c = torch.tensor(rows), torch.tensor(cols)
            counts = self.counts[c] + torch.tensor(extra, dtype=torch.float32)
            x[r, c] = self._penalise(raw[r, c], counts, torch.ones_like(c, dtype=torch.bool))
        if self.bias is not None:
            x = x + self.bias
        if self.p.min_tokens and len(self.stops):
            short = torch.tensor([self.produced + len(path) < self.p.min_tokens for path in paths])  # [R]
            if bool(short.any()):
                x[short.nonzero()[:, 0][:, None], self.stops[None, :]] = -math.inf
        return x


def make_generator(params: SamplingParams) -> torch.Generator:
    """CPU generator seeded by `params.seed`, or non-deterministically when it is None."""
    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def target_probs(logits: torch.Tensor, params: SamplingParams, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Target distribution per row: temperature, then top-k, then top-p, renormalised.

    logits: [T, V]; returns `dtype` [T, V] (float64: the target's, which verification reproduces),
    rows summing to 1. Not for greedy (temperature 0). Ties at the top-k or top-p cut are all kept,
    so the result never depends on sort order.
    """
    assert logits.dim() == 2, f"logits must be [T, V], got {tuple(logits.shape)}"
    assert not params.greedy, "target_probs is for sampling; greedy uses argmax of the logits"
    x = logits.to(dtype)  # [T, V]
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
    """One token id drawn from probs [V] (need not be normalised): the first whose cumulative mass
    passes a uniform draw times the total, so a zero-probability token is never drawn (its mass
    adds nothing: the cumulative sum first passes the draw at a token that has some).
    torch.multinomial draws the same distribution at 20x the cost (0.9 ms at a 49k vocabulary,
    2.7 ms at 152k: a sixth of a SmolLM2 step), mostly checks and setup."""
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)  # [V]
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    if i == probs.shape[0]:  # the draw times the total rounded up to the total: the last token with mass
        i = int(torch.nonzero(probs > 0)[-1])
    return i


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """`tokens[i]`'s TokenLogprob under logits row i, with `top` alternatives. logits: [T, V]."""
    assert logits.dim() == 2 and logits.shape[0] == len(tokens), (tuple(logits.shape), len(tokens))
    if not tokens:
        return []
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [T, V]
    chosen = lp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()  # [T]
    if not top:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]
    vals, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)  # [T, top]
    return [TokenLogprob(t, c, tuple(zip(i, v))) for t, c, i, v in zip(tokens, chosen, ids.tolist(), vals.tolist())]


@dataclass(frozen=True)
class VerifyResult:
    accepted: list[int]  # node indices of the accepted path, root side first
    bonus: int  # token id sampled (or argmax'd) from the target after the path
    logprobs: list[TokenLogprob] | None = None  # of `tokens(tree)`, when the step was asked for them

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
    tree: DraftTree, probs: torch.Tensor | Callable[[int], torch.Tensor], generator: torch.Generator
) -> VerifyResult:
    """Recursive rejection sampling over the tree; the output is distributed as the target.

    probs: [N+1, V] target distributions (rows of `target_probs`), row 0 for the root's children,
    row i+1 for node i's children; or a function from a row index to that row [V], so that only the
    rows the walk reaches are computed (`verify_tree`). Children of a node must be i.i.d. draws
    from its q.
    """
    if callable(probs):
        row = probs
    else:
        _check_rows(tree, probs)
        table = probs.to(torch.float64)  # [N+1, V]
        row = table.__getitem__
    kids = children_of(tree)
    q_index = {node: j for j, node in enumerate(tree.q_nodes)}
    accepted: list[int] = []
    node = ROOT
    while True:
        p = row(node + 1).to(torch.float64)  # [V]
        children = kids[node]
        if not children:
            return VerifyResult(accepted=accepted, bonus=sample_token(p, generator))
        assert node in q_index, f"node {node} has children but no q (tree not validated?)"
        j = q_index[node]
        q = sparse_to_dense(tree.q_ids[j], tree.q_probs[j], p.shape[0])  # [V]
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
    _check_rows(tree, logits)
    # each row's distribution where the walk reaches it (the accepted path and the bonus's row),
    # not all N + 1: a row is its own computation (`target_probs` works row by row), and at a
    # 152k vocabulary one float64 row costs 0.5-1 ms
    return verify_sampling(tree, lambda i: target_probs(logits[i:i + 1], params)[0], generator)
