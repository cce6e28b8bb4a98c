"""The drafter contract and the one tree-growing loop every drafter shares.

A `Drafter` opens a `DraftSession` per generation (or per served session). The session is told the
full context once, then after each verification step the committed tokens (accepted + bonus);
`draft` returns a `DraftTree` whose root is the last context token.

`grow_tree` builds trees level by level. At each level it decides how many children each frontier
node gets from the frontier's scores alone (the best node gets `width`, the next `width - 1`
best get one each, within the node budget, keeping one node for every deeper level), then asks
the drafter's `expand` for that many children per node. For sampling, `expand` draws them
i.i.d. from a q it reports, so the shape never depends on the children's own values — the
condition `sampling.verify_sampling` needs to stay lossless. A chain is `budget == depth`.
`grow_trees` grows several trees together, one `expand` call per level for all of them.

A turn's `DraftGuide` makes the drafter's q follow what shapes the target's distribution beyond
its model (`TreeGuide`, in `grow_trees`): a grammar prunes every node's children to the tokens
it allows after the node's path, and penalties (repetition, frequency, presence, logit_bias)
apply to the drafter's logits with the counts of the turn's output plus the path, as they apply
to the target's at verification. Greedy keeps the drafter's likeliest tokens of that
distribution; sampling draws the children from it (renormalised over the allowed tokens) and
reports it as q. A tree then holds no node verification would refuse, and acceptance is measured
against the target verification uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from specmesh.sampling import Penalizer, SamplingParams, target_probs
from specmesh.tree import ROOT, DraftTree

MAX_WIDTH = 8
GUIDE_SLACK = 8  # under a grammar, children asked for beyond those wanted (greedy: some are pruned)


@dataclass(frozen=True)
class Children:
    """What `expand` returns for one node: child tokens, their log-scores, optional sparse q, and
    the drafter's whole distribution they came from where it has one (a guide re-picks from it)."""

    tokens: list[int]
    logprobs: list[float]
    q_ids: list[int] | None = None
    q_probs: list[float] | None = None
    probs: torch.Tensor | None = None  # [V]
    logits: torch.Tensor | None = None  # [V] the drafter's raw logits behind `probs`, where it has them


# expand(nodes, paths, counts) -> Children per node. Node ids index the tree being grown (ROOT for
# the root), paths are the draft tokens from the root down to each node (() for the root); the
# nodes of one call are all at the same depth.
ExpandFn = Callable[[list[int], list[tuple[int, ...]], list[int]], list[Children]]


def tree_width(budget: int, depth: int) -> int:
    """Children of the best node per level: 1 for a chain, wider as the budget grows."""
    return max(1, min(MAX_WIDTH, math.ceil(budget / max(depth, 1))))


def drafter_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] logits -> [R, V] a drafter's distribution (the request's temperature, top-k and top-p
    when sampling; softmax when greedy), in float32: a drafter's q only needs to be what it
    reports (`children_from_probs` renormalises its top ids in float64 and draws from exactly
    that); float64 costs about 5x as much a row (0.5-1 ms at a 152k vocabulary)."""
    if params.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return target_probs(logits, params, torch.float32)


class DraftGuide:
    """A turn's shaping of the drafter's q (see the module docstring): its sampling `params` (the
    penalties among them), where its output begins in the context (`start`), and its grammar
    (`specmesh.grammar.Guide`, or None)."""

    def __init__(self, params: SamplingParams, start: int, grammar=None) -> None:
        self.params, self.start, self.grammar = params, start, grammar
        self._penalizer: Penalizer | None = None

    def penalizer(self, context: list[int], vocab_size: int) -> Penalizer | None:
        """The turn's penalties over the context before its output (built on first use)."""
        if not self.params.penalised:
            return None
        if self._penalizer is None:
            # no stop ids: a drafter does not know them (min_tokens is left to verification)
            self._penalizer = Penalizer(self.params, vocab_size, context[:self.start], frozenset())
        return self._penalizer


def turn_guide(params: SamplingParams, start: int, grammar=None) -> DraftGuide | None:
    """The DraftGuide of a turn whose output begins after `start` context tokens (None when nothing
    beyond the drafter's model shapes its distribution)."""
    return DraftGuide(params, start, grammar) if grammar is not None or params.penalised else None


class TreeGuide:
    """A DraftGuide bound to one `grow_trees` call: tree i is rooted after `context[:roots[i]]`."""

    def __init__(self, guide: DraftGuide, context: list[int], roots: Sequence[int], generator: torch.Generator) -> None:
        self.guide, self.context, self.roots, self.generator = guide, context, list(roots), generator

    def prune(self, tree: int, path: tuple[int, ...], kids: Children, count: int) -> Children:
        """At most `count` children after `path`, of the drafter's distribution shaped as the
        target's is: penalised, then only the tokens the grammar allows."""
        g, root = self.guide, self.roots[tree]
        probs = None if kids.probs is None else kids.probs.cpu()  # the guide's tensors are on the CPU
        if root < g.start:  # a root before the turn's output: nothing known to shape it by
            return kids
        seq = self.context[g.start:root] + list(path)  # the turn's output up to the node
        penalised = False
        if kids.logits is not None:
            pen = g.penalizer(self.context, kids.logits.shape[0])
            if pen is not None:
                probs = drafter_probs(pen.after(kids.logits.cpu()[None], [seq]), g.params)[0]
                penalised = True
        allowed = None if g.grammar is None else g.grammar.allowed(seq)
        if allowed is None:
            if not penalised:
                return kids
            return _pick(probs, count, g.params.greedy, self.generator, masked=True)
        n = allowed.shape[0]
        if probs is not None and probs.shape[0] == n:  # re-pick from the masked distribution
            return _pick(probs.masked_fill(~allowed, 0.0), count, g.params.greedy, self.generator, masked=True)
        if kids.q_ids is None:  # greedy: the drafter's likeliest tokens that are allowed
            keep = [i for i, t in enumerate(kids.tokens) if t < n and allowed[t]][:count]
            return Children([kids.tokens[i] for i in keep], [kids.logprobs[i] for i in keep])
        ok = [i for i, t in enumerate(kids.q_ids) if t < n and allowed[t]]
        q = torch.tensor([kids.q_probs[i] for i in ok], dtype=torch.float64)
        if not ok or not q.sum() > 0:
            return Children([], [])
        ids, q = [kids.q_ids[i] for i in ok], q / q.sum()
        draws = torch.multinomial(q, count, replacement=True, generator=self.generator).tolist()
        return Children([ids[d] for d in draws], q[draws].log().tolist(), q_ids=ids, q_probs=q.tolist())


def guided(guide) -> dict:
    """The `guide` keyword of a draft call: none without a grammar, so that a DraftSession that
    takes no guide (one outside specmesh) drafts as before."""
    return {} if guide is None else {"guide": guide}


def bind_guide(guide: DraftGuide | None, context: list[int], roots: Sequence[int],
               generator: torch.Generator) -> TreeGuide | None:
    """`guide` (or None) bound to the trees of one call rooted at `roots`."""
    return None if guide is None else TreeGuide(guide, context, roots, generator)


def grow_tree(expand: ExpandFn, budget: int, depth: int, exclude_root: Sequence[int] = (),
              branches: int = 0, guide: TreeGuide | None = None) -> DraftTree:
    """`exclude_root`: tokens the root's children must not be (a predraft for an outcome in which
    the verifier rejected them: its bonus token cannot be one of them). The root asks `expand` for
    that many more children and drops those tokens. The root's children are then no longer plain
    draws from the root's q, so such a tree is only for re-rooting: under sampling only subtrees
    under its root's children may be verified (`specmesh.drafters.predraft`), never the tree.

    `branches` > 0: the root gets that many children, and each of them a subtree planned on its
    own, of (budget - branches) // branches nodes and depth - 1 levels (a predraft: every
    candidate for the bonus token gets a whole tree under it, the second likeliest too).
    `guide`: what shapes the children's distribution (see the module docstring)."""
    return grow_trees(lambda _trees, nodes, paths, counts: expand(nodes, paths, counts),
                      [(budget, depth, exclude_root, branches)], guide)[0]


# expand(trees, nodes, paths, counts) -> Children per entry: as ExpandFn, each entry also naming
# which of the trees being grown together its node belongs to (an index into grow_trees' shapes).
TreesExpandFn = Callable[[list[int], list[int], list[tuple[int, ...]], list[int]], list[Children]]


def grow_trees(expand: TreesExpandFn, shapes: Sequence[tuple[int, int, Sequence[int], int]],
               guide: TreeGuide | None = None) -> list[DraftTree]:
    """Several trees grown together, one `expand` call per level for all of them: tree i has shape
    `shapes[i]` = (budget, depth, exclude_root, branches) and grows exactly as `grow_tree` would
    grow it alone (its shape is planned from its own frontier only), so each is as lossless as a
    tree drafted on its own. A drafter whose level costs one forward whatever its width (a small
    model on an accelerator) drafts many trees for the price of the deepest: drafting ahead
    (`specmesh.drafters.predraft`) predrafts every likely outcome of a step at once this way.
    `guide`: what shapes every tree's children (see the module docstring)."""
    growing = [_Growth(*shape) for shape in shapes]
    level = 1
    while True:
        trees: list[int] = []
        nodes: list[int] = []
        counts: list[int] = []
        for t, g in enumerate(growing):
            for node, count in zip(*g.plan(level)):
                trees.append(t)
                nodes.append(node)
                counts.append(count)
        if not nodes:
            return [g.tree() for g in growing]
        asked = [c + len(growing[t].exclude) if n == ROOT else c for t, n, c in zip(trees, nodes, counts)]
        paths = [growing[t].path[n] for t, n in zip(trees, nodes)]
        if guide is None:
            kids = expand(trees, nodes, paths, asked)
        else:
            kids = expand(trees, nodes, paths, [c + GUIDE_SLACK for c in asked])
            kids = [guide.prune(t, path, k, c) for t, path, k, c in zip(trees, paths, kids, asked)]
        for t, g in enumerate(growing):
            g.frontier = []
        for t, node, count, k in zip(trees, nodes, counts, kids):
            growing[t].attach(node, count, k)
        level += 1


class _Growth:
    """One tree of `grow_trees`. Its nodes below the root are planned in groups: one group (the
    root's) for a plain tree, one per root child with `branches`. At each level a group decides how
    many children each of its frontier nodes gets from their scores alone (the best node gets
    `width`, the next `width - 1` best one each, within the group's node budget, keeping one node
    for every deeper level)."""

    def __init__(self, budget: int, depth: int, exclude_root: Sequence[int], branches: int = 0) -> None:
        self.exclude = tuple(exclude_root)
        self.branches = min(branches, budget)
        self.depth = min(depth, budget)
        if self.branches:
            sub = (budget - self.branches) // self.branches
            self.sub_shape = (sub, min(depth - 1, sub), 1)
            self.depth = 1 + self.sub_shape[1]
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.score: dict[int, float] = {ROOT: 0.0}
        self.path: dict[int, tuple[int, ...]] = {ROOT: ()}
        self.q_nodes: list[int] = []
        self.q_ids: list[list[int]] = []
        self.q_probs: list[list[float]] = []
        self.frontier = [ROOT] if self.depth > 0 else []
        self.group: dict[int, int] = {ROOT: ROOT}  # node -> the node its group grows under
        self.groups: dict[int, tuple[int, int, int]] = {}  # group -> (budget, depth, levels above it)
        self.used: dict[int, int] = {}  # group -> nodes it has
        if not self.branches:
            self.groups[ROOT], self.used[ROOT] = (budget, self.depth, 0), 0

    def plan(self, level: int) -> tuple[list[int], list[int]]:
        """The nodes to expand at `level` and how many children each gets (none: the tree is done)."""
        if level > self.depth:
            return [], []
        if self.branches and level == 1:
            return [ROOT], [self.branches]
        nodes, counts = [], []
        for g, (budget, depth, above) in self.groups.items():
            if level - above > depth:
                continue
            allowed = budget - self.used[g] - (depth - (level - above))
            width = tree_width(budget, depth)
            mine = [n for n in self.frontier if self.group[n] == g]
            for i, node in enumerate(sorted(mine, key=lambda n: -self.score[n])[:width]):
                c = min(width if i == 0 else 1, allowed)
                if c <= 0:
                    break
                nodes.append(node)
                counts.append(c)
                allowed -= c
        return nodes, counts

    def attach(self, node: int, count: int, kids: Children) -> None:
        if node == ROOT and self.exclude:
            kept = [i for i, t in enumerate(kids.tokens) if t not in self.exclude][:count]
            kids = Children([kids.tokens[i] for i in kept], [kids.logprobs[i] for i in kept],
                            kids.q_ids, kids.q_probs)
        assert len(kids.tokens) <= count
        if kids.q_ids is not None:
            self.q_nodes.append(node)
            self.q_ids.append(kids.q_ids)
            self.q_probs.append(kids.q_probs)
        for tok, lp in zip(kids.tokens, kids.logprobs):
            i = len(self.tokens)
            self.score[i] = self.score[node] + lp
            self.path[i] = self.path[node] + (tok,)
            self.frontier.append(i)
            self.tokens.append(tok)
            self.parents.append(node)
            if self.branches and node == ROOT:  # a group of its own
                self.group[i], self.groups[i], self.used[i] = i, self.sub_shape, 0
            else:
                self.group[i] = self.group[node]
                self.used[self.group[i]] += 1

    def tree(self) -> DraftTree:
        return DraftTree(self.tokens, self.parents, self.q_nodes, self.q_ids, self.q_probs)


def children_from_probs(
    probs: torch.Tensor,  # [V] the drafter's distribution for this node's children
    count: int,
    params: SamplingParams,
    generator: torch.Generator,
    q_top: int = 64,
    logits: torch.Tensor | None = None,  # [V] the raw logits behind `probs`, where the drafter has them
) -> Children:
    """Greedy: the `count` most likely tokens. Sampling: `count` i.i.d. draws from q = probs
    truncated to its `q_top` most likely ids and renormalised, reported exactly (sparse)."""
    kids = _pick(probs, count, params.greedy, generator, q_top)
    return kids if logits is None else replace(kids, logits=logits)


def _pick(probs: torch.Tensor, count: int, greedy: bool, generator: torch.Generator, q_top: int = 64,
          masked: bool = False) -> Children:
    """`children_from_probs`. `masked`: `probs` has the tokens a grammar forbids at 0, and greedy
    picks none of them either (no token left: no children)."""
    top_p, top_i = probs.topk(min(q_top, probs.shape[0]))  # [K], [K]
    if greedy:
        if masked:
            top_i, top_p = top_i[top_p > 0], top_p[top_p > 0]
        return Children(top_i[:count].tolist(), top_p[:count].clamp_min(1e-30).log().tolist(), probs=probs)
    total = top_p.double().sum()
    if not total > 0:
        return Children([], [])
    q = top_p.double() / total  # [K]
    keep = q > 0
    q, ids = q[keep], top_i[keep]
    draws = torch.multinomial(q, count, replacement=True, generator=generator)  # [count]
    return Children(ids[draws].tolist(), q[draws].log().tolist(), q_ids=ids.tolist(), q_probs=q.tolist(), probs=probs)


class FeatureRows:
    """A growing [n, width] matrix of per-token rows (a feature drafter's target features): append
    and truncate cost what they write, not the history (capacity doubles), so a long session pays
    O(1) per step instead of a copy of everything it kept."""

    def __init__(self, width: int, capacity: int, dtype: torch.dtype) -> None:
        self._buf = torch.empty(max(capacity, 1), width, dtype=dtype)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def width(self) -> int:
        return self._buf.shape[1]

    def view(self) -> torch.Tensor:
        """[n, width], a view: valid until the next append."""
        return self._buf[:self._n]

    def truncate(self, n: int) -> None:
        assert 0 <= n <= self._n, (n, self._n)
        self._n = n

    def append(self, rows: torch.Tensor) -> None:
        end = self._n + rows.shape[0]
        if end > self._buf.shape[0]:
            grown = self._buf.new_empty(max(2 * self._buf.shape[0], end), self.width)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        self._buf[self._n:end] = rows.to(self._buf.device, self._buf.dtype)
        self._n = end


def node_mask(paths: list[tuple[int, ...]], context_rows: int | Sequence[int], at: int,
              slot_of: dict, trees: Sequence[int] | None = None) -> torch.Tensor:
    """[T, at + T] bool for feeding one tree level at scratch slots [at, at + T): each node sees the
    first `context_rows` cache slots (one count for all, or one per node), its ancestors' slots
    (`slot_of[path prefix]`, or `slot_of[(trees[row], path prefix)]` for trees grown together)
    and itself."""
    rows = [context_rows] * len(paths) if isinstance(context_rows, int) else context_rows
    mask = torch.zeros(len(paths), at + len(paths), dtype=torch.bool)
    for row, path in enumerate(paths):
        mask[row, :rows[row]] = True
        for k in range(1, len(path)):
            mask[row, slot_of[path[:k] if trees is None else (trees[row], path[:k])]] = True
        mask[row, at + row] = True
    return mask


class DraftSession(Protocol):
    def draft(self, budget: int, depth: int, params: SamplingParams, generator: torch.Generator,
              exclude_root: Sequence[int] = (), branches: int = 0, guide=None) -> DraftTree:
        """A tree rooted at the last context token (`grow_tree`; `exclude_root`, `branches`: see
        there); `guide`: the turn's `DraftGuide` (a grammar, penalties), or None."""

    def commit(self, tokens: list[int], features: torch.Tensor | None = None) -> None:
        """Tokens committed by the verifier since the last call (accepted path + bonus), or new
        tokens of a follow-up turn; `features`: the target's, for drafters that take them
        (`Drafter.needs_features`; see `specmesh.drafters.feature`), else None."""

    def rollback(self, num_tokens: int) -> None:
        """Forget the context after its first `num_tokens` tokens (undo a speculative commit)."""

    def close(self) -> None: ...


class ManyDraftSession(DraftSession, Protocol):
    """A DraftSession that can also grow trees rooted at several points of its context at once
    (`grow_trees`: one expansion per level for all of them). Drafters whose level cost barely
    depends on its width (model drafters; the oracle's cost model) have it; drafting ahead uses it
    when present (`hasattr(session, "draft_many")`) and drafts one tree at a time otherwise."""

    def draft_many(self, roots: Sequence[int], budget: int, depth: int, params: SamplingParams,
                   generator: torch.Generator, excludes: Sequence[Sequence[int]], branches: int = 0,
                   guide=None) -> list[DraftTree]:
        """Tree i rooted at the context's first `roots[i]` tokens (1 <= roots[i] <= len(context)),
        grown as `draft` would grow it there with `exclude_root=excludes[i]`. The context stays."""


class ContextSession:
    """The state of drafters that keep nothing but the token context (ngram, oracle)."""

    def __init__(self, context: list[int]) -> None:
        self.context = context

    def commit(self, tokens: list[int], features: torch.Tensor | None = None) -> None:
        self.context.extend(tokens)

    def rollback(self, num_tokens: int) -> None:
        assert 1 <= num_tokens <= len(self.context)
        del self.context[num_tokens:]

    def close(self) -> None:
        self.context = []


class Drafter(Protocol):
    name: str
    needs_features: bool  # drafts from the target's hidden states (the verifier must send them)

    def open(self, context: list[int], features: torch.Tensor | None = None) -> DraftSession:
        """A session for `context`; `features`: [len(context) - 1, hidden] target features when
        `needs_features`, else None."""
