"""In-process speculative generation: one target, one drafter, one loop.

`TargetSession` is the verifier's side of one session: the target KV cache of everything
committed except the **pending** token (the last committed token, whose K/V is computed by the
next step). One `step(tree)` runs a single forward over [pending] + tree nodes with the tree mask
and depth-based positions, verifies, commits the pending token and the accepted nodes, and makes
the bonus token the new pending one. With an empty tree it is plain autoregressive decoding, so
`--drafter none` runs the very same code.

With `features=True` the session also keeps the target's final hidden state of every committed
token but the pending one (fp16, `features[j]` is the state after `tokens[j]`, the one that predicted
`tokens[j + 1]`): what a feature drafter (EAGLE-style, `specmesh.drafters.feature`) drafts from.
The forward computes them anyway; keeping them costs hidden_size x 2 bytes per token.

`generate` drives a TargetSession and a DraftSession, applies stop conditions, and measures. Its
trees are planned as a drafter service plans them (`PlannedDrafts`: `specmesh.planner` over the
pair's costs, measured once per process), or drafted as the fixed shape asked for (`LocalDrafts`).
The engine works on token ids only; text (stop strings) goes through an optional `decode`.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch

from specmesh.costs import Costs, StepTable
from specmesh.drafters.base import Drafter, DraftSession, FeatureRows, guided, turn_guide
from specmesh.model import Transformer
from specmesh.limits import MAX_DEPTH, MAX_TREE_NODES, check_ids
from specmesh.logprobs import TokenLogprob, check_logprobs
from specmesh.planner import Acceptance
from specmesh.sampling import Penalizer, SamplingParams, VerifyResult, make_generator, token_logprobs, verify_tree
from specmesh.text import StopConditions, first_stop  # StopConditions: in generate's signature, so also here
from specmesh.tree import DraftTree, InvalidTreeError, depths, tree_attention_mask, validate_tree

if TYPE_CHECKING:
    from specmesh.drafters.predraft import StepTree
    from specmesh.grammar import Constraint



@dataclass(frozen=True)
class SpecConfig:
    """Speculation shape: `budget` draft nodes per step, at most `depth` deep (chain: equal). A
    remote drafter's planner (`specmesh.planner`) picks each step's shape within them; `fixed`:
    exactly this shape. The in-process engine plans as a drafter service does (`PlannedDrafts`)."""

    budget: int = 8
    depth: int = 4
    fixed: bool = False

    def validate(self) -> None:
        if not 1 <= self.budget <= MAX_TREE_NODES:
            raise ValueError(f"tree_budget: must be in [1, {MAX_TREE_NODES}], got {self.budget}")
        if not 1 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"depth: must be in [1, {MAX_DEPTH}], got {self.depth}")


class Shape(Protocol):
    """What makes the target distribution of a turn out of its logits beyond sampling settings:
    penalties (`sampling.Penalizer`), a grammar (`grammar.Constraint`). Called on one step's rows
    (each tree row continuing its own path), then told the tokens the step emitted."""

    def __call__(self, logits: torch.Tensor, parents: list[int], tokens: list[int]) -> torch.Tensor: ...

    def add(self, tokens: list[int]) -> None: ...


class Shapes:
    """Several Shapes applied in order (penalties, then the grammar's mask)."""

    def __init__(self, shapes: list[Shape]) -> None:
        self.shapes = shapes

    def __call__(self, logits: torch.Tensor, parents: list[int], tokens: list[int]) -> torch.Tensor:
        for s in self.shapes:
            logits = s(logits, parents, tokens)
        return logits

    def add(self, tokens: list[int]) -> None:
        for s in self.shapes:
            s.add(tokens)


class TargetSession:
    def __init__(self, model: Transformer, prompt_ids: list[int], features: bool = False,
                 prompt_logprobs: int | None = None) -> None:
        if not prompt_ids:
            raise ValueError("prompt: at least one token is required")
        check_ids(prompt_ids, model.config.vocab_size, "prompt")
        self.model = model
        self.cache = model.new_cache(len(prompt_ids) + 64)
        self.tokens: list[int] = []
        self.pending: int = -1
        # fp16, len(tokens) - 1 rows: the state after each committed token but the pending one
        self._features = FeatureRows(model.config.hidden_size, len(prompt_ids) + 64,
                                     torch.float16) if features else None
        # with `prompt_logprobs` (alternatives per token): the prompt's TokenLogprobs, see `extend`
        self.prompt_logprobs = self.extend(prompt_ids, prompt_logprobs)

    @property
    def features(self) -> torch.Tensor | None:
        """[len(tokens) - 1, H]: the target's state after each committed token but the pending one."""
        return None if self._features is None else self._features.view()

    def _keep_features(self, hidden: torch.Tensor, rows: list[int] | None = None) -> None:
        """Store the states that pair with the tokens about to be committed (call before committing)."""
        self._features.truncate(max(len(self.tokens) - 1, 0))
        self._features.append(hidden if rows is None else hidden[rows])

    def new_features(self, count: int) -> torch.Tensor | None:
        """The rows that pair with the last `count` committed tokens (None when this session keeps
        no features)."""
        f = self.features
        return None if f is None else f[len(f) - count:]

    def extend(self, new_ids: list[int], logprobs: int | None = None) -> list[TokenLogprob] | None:
        """Prefill new committed tokens (a prompt or a follow-up turn); only what is new. With
        `logprobs` (alternatives per token), also return each new token's TokenLogprob under the
        target given what precedes it (the first token of a session has none: logprob None)."""
        if not new_ids:
            return [] if logprobs is not None else None
        had_pending = self.pending >= 0
        feed = ([self.pending] if had_pending else []) + list(new_ids[:-1])
        lps = None if logprobs is None else [] if had_pending else [TokenLogprob(new_ids[0], None)]
        if feed:
            start = self.cache.length
            want = self._features is not None
            out = self.model(torch.tensor(feed), torch.arange(start, start + len(feed)), self.cache, start,
                             logits_rows=None if logprobs is None else slice(None), hidden=want)
            if logprobs is not None:
                lps += token_logprobs(out[0] if want else out, list(new_ids[not had_pending:]), logprobs)
            if want:
                self._keep_features(out[1])
            self.cache.commit(list(range(start, start + len(feed))))
        self.tokens.extend(new_ids)
        self.pending = new_ids[-1]
        return lps

    def step(self, tree: DraftTree, params: SamplingParams, generator: torch.Generator,
             logprobs: int | None = None, shape: Shape | None = None) -> tuple[VerifyResult, list[int]]:
        """Verify one (already validated) tree; commit; return the result and the new tokens. With
        `logprobs` (alternatives per token) the result carries the new tokens' TokenLogprobs, from
        the rows of this same forward that verified them (raw: before `shape`, the penalties and
        grammar that make the distribution the tree is verified against)."""
        model, cache = self.model, self.cache
        start = cache.length
        n = len(tree)
        toks = torch.tensor([self.pending] + tree.tokens)  # [1 + N]
        pos = torch.tensor([0] + depths(tree.parents)) + start  # [1 + N]
        mask = None
        if n:
            mask = torch.ones(1 + n, start + 1 + n, dtype=torch.bool)  # [1 + N, S]
            mask[0, start + 1:] = False
            mask[1:, start + 1:] = tree_attention_mask(tree.parents)
        want = self._features is not None
        out = model(toks, pos, cache, start, mask, hidden=want)
        logits = out[0] if want else out  # [1 + N, V]
        shaped = logits if shape is None else shape(logits, tree.parents, tree.tokens)
        result = verify_tree(tree, shaped, params, generator)
        cache.commit([start] + [start + 1 + i for i in result.accepted])
        path = [0] + [1 + i for i in result.accepted]  # the rows that predicted the new tokens
        if want:
            self._keep_features(out[1], path)
        new = result.tokens(tree)
        if logprobs is not None:
            result = replace(result, logprobs=token_logprobs(logits[path], new, logprobs))
        self.tokens.extend(new)
        self.pending = new[-1]
        return result, new

    def close(self) -> None:
        """Free the KV cache (on every rank, under tensor parallelism)."""
        self.cache.close()

    def rollback(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` committed tokens (drop tokens never delivered)."""
        assert 1 <= num_tokens <= len(self.tokens)
        self.tokens = self.tokens[:num_tokens]
        self.cache.truncate(num_tokens - 1)
        if self._features is not None:
            self._features.truncate(num_tokens - 1)
        self.pending = self.tokens[-1]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rejected_trees: int = 0
    draft_s: float = 0.0  # getting trees, and handing each step's outcome to the drafter (a planned
    verify_s: float = 0.0  # in-process drafter drafts the next tree then); verify_s: the target's steps
    total_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per step (the bonus token not counted)."""
        return self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("acceptance_rate", "mean_accepted_length", "tokens_per_step", "tokens_per_s"):
            d[name] = getattr(self, name)
        return d


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (eos, stop id or stop string) | "length"
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, when asked for


class TreeSource(Protocol):
    """Where a turn's draft trees come from: an in-process DraftSession or a remote drafter."""

    def next_tree(self, budget: int) -> DraftTree:
        """The tree for the next step (at most `budget` nodes wanted); empty = no speculation."""

    def committed(self, tree: DraftTree, result: VerifyResult, new_tokens: list[int],
                  features: torch.Tensor | None = None, verify_s: float = 0.0) -> None:
        """The outcome of verifying `tree` (with the target features pairing with `new_tokens` when
        the target session keeps them), and how long the verification's forward took."""


class LocalDrafts:
    """TreeSource over an in-process DraftSession, drafting `spec`'s shape every step as drafted
    (the engine validates a drafter's raw trees); `guide`: what shapes the turn's q beyond the
    drafter's model (`drafters.base.DraftGuide`: a grammar, penalties), or None."""

    def __init__(self, session: DraftSession, spec: SpecConfig, params: SamplingParams,
                 generator: torch.Generator, guide=None) -> None:
        self.session, self.spec, self.params, self.generator = session, spec, params, generator
        self.guide = guide

    def next_tree(self, budget: int) -> DraftTree:
        return self.session.draft(min(budget, self.spec.budget), self.spec.depth, self.params, self.generator,
                                  **guided(self.guide))

    def committed(self, tree: DraftTree, result: VerifyResult, new_tokens: list[int],
                  features: torch.Tensor | None = None, verify_s: float = 0.0) -> None:
        self.session.commit(new_tokens, features)

    def close(self) -> None:
        self.session.close()


class PlannedDrafts:
    """TreeSource over an in-process DraftSession, planned as a drafter service plans it: each tree
    comes from a `DraftAhead` (not pipelined) whose planner picks the step's shape within `spec`'s
    caps, or a run of one-row steps without a tree (`StepTree.plain`), from what `planning`
    measured on this machine (`planning_for`); `grammar`: the turn's (`specmesh.grammar.Guide`), or
    None. A plain run is kept as a remote drafter's is (`verifier_service.drafter_link.RemoteDrafts`):
    its tokens go to the drafter in one extension at its end."""

    def __init__(self, session: DraftSession, context_len: int, spec: SpecConfig, params: SamplingParams,
                 planning: LocalPlanning, grammar=None) -> None:
        from specmesh.drafters.predraft import DraftAhead

        planning.costs.set_verify_cost(planning.steps.points())
        self.spec, self.planning = spec, planning
        self.ahead = DraftAhead(session, context_len, params, False, costs=planning.costs, recent=planning.recent,
                                grammar=grammar)
        self._next: StepTree | None = None
        self._run_left = 0  # one-row steps left in the plain run asked for (this one included)
        self._run: list[int] = []
        self._run_features: list[torch.Tensor] = []

    def next_tree(self, budget: int) -> DraftTree:
        if self._next is None:
            self._next = self.ahead.first(self.spec.budget, self.spec.depth)
        if self._run_left:
            return DraftTree.empty()
        tree = self._next.tree
        if not tree.tokens and self._next.plain > 1:
            self._run_left = self._next.plain
        return tree

    def committed(self, tree: DraftTree, result: VerifyResult, new_tokens: list[int],
                  features: torch.Tensor | None = None, verify_s: float = 0.0) -> None:
        assert self._next is not None
        if verify_s > 0:
            self.planning.steps.add(1 + len(tree), verify_s)
        b, d = self.spec.budget, self.spec.depth
        if self._run_left:
            self._run_left -= 1
            self._run.extend(new_tokens)
            if features is not None:
                self._run_features.append(features)
            if not self._run_left:
                fed = torch.cat(self._run_features) if self._run_features else None
                self._next = self.ahead.extend(self._run, b, d, features=fed, same_turn=True)
                self._run, self._run_features = [], []
            return
        self._next = self.ahead.commit(self._next.step, new_tokens[:-1], new_tokens[-1], b, d, features,
                                       verify_s=verify_s)

    def close(self) -> None:
        self.ahead.close()


@dataclass
class LocalPlanning:
    """What the in-process planner measured for one (target, drafter) pair, kept for the process's
    later generations as a drafter service keeps it for its sessions: the drafter's costs
    (`drafter_calls` on first use), its recent sessions' acceptance, and the target's step by rows
    (`target_steps` on first use, corrected by live steps: `StepTable`)."""

    costs: Costs
    recent: Acceptance
    steps: StepTable
    drafter: weakref.ref  # the entry is found by the drafter's identity (not held: it may hold the target)


_planning: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target model -> [LocalPlanning]


COST_CACHE_ENV = "SPECMESH_COST_CACHE"  # "0": measure a pair's costs in every process, never read them back


def planning_for(model: Transformer, drafter: Drafter) -> LocalPlanning:
    """The pair's `LocalPlanning`: its costs measured the first time in a process (`pair_costs`),
    then kept for the process's later generations."""
    from specmesh.drafters.predraft import fit_calibration

    entries = _planning.setdefault(model, [])
    entries[:] = [e for e in entries if e.drafter() is not None]
    for e in entries:
        if e.drafter() is drafter:
            return e
    measured = pair_costs(model, drafter)
    costs = Costs()
    fit_calibration(costs, measured)
    costs.link_s = 0.0  # no link in process (what a step's window holds beyond the forward is measured)
    e = LocalPlanning(costs, Acceptance(), StepTable(measured["steps"]), weakref.ref(drafter))
    entries.append(e)
    return e


def pair_costs(model: Transformer, drafter: Drafter) -> dict:
    """A pair's costs as the planner takes them: the target's step by rows (`target_steps`) and the
    drafter's timed calls (`drafter_calls`), a few seconds for a 1.5B target on a CPU, each kept
    per machine."""
    return {"steps": target_steps(model), **drafter_calls(drafter, model.config.vocab_size)}


def target_steps(model: Transformer) -> list:
    """The target's step by rows (`measure_steps`), kept (`kept_costs`) by its layout; a TP
    group's (not one module in this process) is measured every time."""
    from specmesh import kernels

    if not isinstance(model, torch.nn.Module):
        return measure_steps(model)
    return kept_costs("steps", {"target": kernels.layout_key(model), "rows": list(STEP_ROWS),
                                "timed": "in runs, 2 passes"},
                      lambda: {"steps": measure_steps(model)})["steps"]


def drafter_calls(drafter: Drafter, vocab_size: int | None) -> dict:
    """The drafter's timed calls (`predraft.drafter_samples`), kept (`kept_costs`) by its model's
    layout; a drafter without a model (n-gram, oracle) is measured every time."""
    from specmesh import kernels
    from specmesh.drafters.predraft import drafter_samples

    held = getattr(drafter, "model", None)
    measure = lambda: drafter_samples(drafter, vocab_size)  # noqa: E731
    if not isinstance(held, torch.nn.Module):
        return measure()
    return kept_costs("drafter", {"drafter": [type(drafter).__name__, kernels.layout_key(held)]}, measure)


def kept_costs(what: str, key: dict, measure: Callable[[], dict]) -> dict:
    """`measure()`, or what it returned in an earlier process with the same key. Costs follow from
    layouts, not weight values: they are kept on disk (`$SPECMESH_CACHE/costs`) keyed by `key` (a
    model's layout) and this process's machine, threads and kernel choices (`kernels.machine_key`).
    Live steps correct them as they always do. `SPECMESH_COST_CACHE=0` measures every time."""
    from specmesh import kernels
    from specmesh.kernels.dispatch import cached_json
    from specmesh.paths import cache_root

    if os.environ.get(COST_CACHE_ENV, "1") == "0":
        return measure()
    full = {"what": f"{what} costs", "machine": kernels.machine_key(), **key}
    return cached_json(cache_root() / "costs", what, full, measure)[0]


def run_turn(
    target: TargetSession,
    source: TreeSource | None,
    params: SamplingParams,
    generator: torch.Generator,
    stop: StopConditions,
    decode: Callable[[list[int]], str] | None = None,
    result: GenerationResult | None = None,
    logprobs: int | None = None,
    resumed_output: int = 0,
    constraint: Shape | None = None,
) -> Iterator[list[int]]:
    """The speculation loop of one turn: draft, validate, verify, commit, stop. Yields the new
    token ids of each step; fills `result` (with `logprobs` alternatives per token: its
    `logprobs`, one per token id). `resumed_output`: the target's last tokens that are this
    turn's output already (a resumed turn: penalties count them). `constraint`: a grammar the
    output must match (`grammar.Constraint`), applied after the penalties. Afterwards the target holds
    exactly the delivered tokens (tokens past a stop or max_tokens are rolled back), so the next
    turn can extend it."""
    res = result if result is not None else GenerationResult()
    st = res.stats
    vocab = target.model.config.vocab_size
    out = res.token_ids
    base = len(target.tokens)
    penalizer = Penalizer(params, vocab, target.tokens, stop.stop_ids, resumed_output) if params.penalised else None
    shapes = [s for s in (penalizer, constraint) if s is not None]
    shape = Shapes(shapes) if shapes else None
    t0 = time.perf_counter()
    while True:
        # 1. draft
        tree = DraftTree.empty()
        if source is not None:
            t = time.perf_counter()
            tree = source.next_tree(stop.max_new_tokens - len(out))
            st.draft_s += time.perf_counter() - t
            try:
                validate_tree(tree, vocab, MAX_TREE_NODES, MAX_DEPTH, need_q=not params.greedy)
            except InvalidTreeError:
                st.rejected_trees += 1  # a bad drafter only costs speed: verify without it
                tree = DraftTree.empty()
        # 2. verify and commit
        t = time.perf_counter()
        verdict, new = target.step(tree, params, generator, logprobs, shape)
        if shape is not None:
            shape.add(new)
        verify_s = time.perf_counter() - t
        st.verify_s += verify_s
        st.steps += 1
        st.drafted_tokens += len(tree)
        st.accepted_tokens += len(verdict.accepted)
        if source is not None:
            t = time.perf_counter()
            source.committed(tree, verdict, new, target.new_features(len(new)), verify_s)
            st.draft_s += time.perf_counter() - t
        # 3. stop conditions
        before = len(out)
        out.extend(new)
        if verdict.logprobs is not None:
            res.logprobs.extend(verdict.logprobs)
        cut = first_stop(out, before, stop.stop_ids, stop.stop_strings, decode)
        if cut is not None and cut > stop.max_new_tokens:
            cut = None  # a stop past max_tokens (say, an EOS bonus token) was never generated
        if cut is not None:
            del out[cut:], res.logprobs[cut:]
            res.finish_reason = "stop"
        elif len(out) >= stop.max_new_tokens:
            del out[stop.max_new_tokens:], res.logprobs[stop.max_new_tokens:]
            res.finish_reason = "length"
        st.new_tokens = len(out)
        st.total_s = time.perf_counter() - t0
        if len(out) > before:
            yield out[before:]
        if cut is not None or len(out) >= stop.max_new_tokens:
            target.rollback(base + len(out))
            return


# rows (pending token + tree nodes) whose step `measure_steps` times: each the default caps allow
# (a planner interpolates between them: a CPU step jumps where rows outgrow the kernel's tile), and
# two past them for larger caps
STEP_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17)


def measure_steps(model: Transformer, rows: tuple[int, ...] = STEP_ROWS, rounds: int = 2,
                  context: int = 32, settle: int = 2, passes: int = 2) -> list[tuple[int, float]]:
    """The target's step (`TargetSession.step`: forward, verification, commit, what `run_turn`
    times as verify_s) by rows, on a chain of rows - 1 nodes after `context` tokens: (rows,
    seconds) per row count: the fastest of its timed steps (`rounds` in each pass; noise only adds),
    and never more than a larger row count's (below). Each row count is timed in a
    run of its own steps after `settle` untimed ones, as a plan runs them (a plain run is one-row
    steps back to back, speculation steps of a few rows): on a CPU the first step after a change
    of rows can cost far more than the ones after it (caches hold the last shape's weights and
    buffers), and timing row counts in turn priced every step at that first-step cost. A
    drafter's planner takes its verification cost's shape from these points (the verifier
    measures them at its start).

    Noise from beside (a drafter starting on the next core, a shared host) only adds, but it comes
    in spells longer than one row count's run: row counts are timed in `passes` passes, the second
    in reverse order, and a row count is never priced above a larger one (it does less of the same
    work: a slower time was such a spell). One pass of runs in turn once put 5 rows at 1.7x 4 rows
    and above 6 rows, where live steps ran at 1.1x 4 rows, and the planner kept its trees a level
    short for whole prompts."""
    params = SamplingParams()
    generator = make_generator(params)
    vocab = model.config.vocab_size
    ids = [1 + i % (vocab - 1) for i in range(context)]
    target = TargetSession(model, ids)
    try:
        def step(n: int) -> float:
            tree = DraftTree([ids[i % context] for i in range(n - 1)], list(range(-1, n - 2)), [], [], [])
            t = time.perf_counter()
            target.step(tree, params, generator)
            seconds = time.perf_counter() - t
            target.rollback(context)
            return seconds

        times: dict[int, list[float]] = {r: [] for r in rows}
        for k in range(passes):
            for r in rows if k % 2 == 0 else rows[::-1]:
                for _ in range(settle):
                    step(r)
                times[r] += [step(r) for _ in range(rounds)]
        fastest = {r: min(ts) for r, ts in times.items()}
        return [(r, min(t for q, t in fastest.items() if q >= r)) for r in rows]
    finally:
        target.close()


def generate_stream(
    model: Transformer,
    prompt_ids: list[int],
    params: SamplingParams,
    stop: StopConditions,
    drafter: Drafter | None = None,
    spec: SpecConfig = SpecConfig(),
    decode: Callable[[list[int]], str] | None = None,
    result: GenerationResult | None = None,
    logprobs: int | None = None,
    constraint: Constraint | None = None,
) -> Iterator[list[int]]:
    """One-shot generation in this process. Yields new token ids step by step; fills `result`
    (with `logprobs` alternatives per token, also its `logprobs`: see `run_turn`)."""
    params.validate()
    params.check_vocab(model.config.vocab_size)
    stop.validate()
    spec.validate()
    check_logprobs(logprobs)
    res = result if result is not None else GenerationResult()
    res.stats.prompt_tokens = len(prompt_ids)
    # a seeded request drafts fixed shapes, as the verifier's do: a plan follows measured times,
    # and the same seed must give the same output. The pair's first plan measures it, untimed.
    planned = drafter is not None and not spec.fixed and params.seed is None
    planning = planning_for(model, drafter) if planned else None
    t0 = time.perf_counter()
    generator = make_generator(params)
    features = drafter is not None and drafter.needs_features
    target = TargetSession(model, prompt_ids, features)
    source = None
    if drafter is not None:
        session = drafter.open(prompt_ids, target.features if features else None)
        grammar = constraint.guide() if constraint is not None else None
        source = (PlannedDrafts(session, len(prompt_ids), spec, params, planning, grammar) if planning is not None
                  else LocalDrafts(session, spec, params, generator, turn_guide(params, len(prompt_ids), grammar)))
    try:
        for chunk in run_turn(target, source, params, generator, stop, decode, res, logprobs, 0, constraint):
            res.stats.total_s = time.perf_counter() - t0  # includes the prefill
            yield chunk
        res.stats.total_s = time.perf_counter() - t0
    finally:
        if source is not None:
            source.close()


def generate(model: Transformer, prompt_ids: list[int], params: SamplingParams, stop: StopConditions,
             drafter: Drafter | None = None, spec: SpecConfig = SpecConfig(),
             decode: Callable[[list[int]], str] | None = None, logprobs: int | None = None,
             constraint: Constraint | None = None) -> GenerationResult:
    res = GenerationResult()
    for _ in generate_stream(model, prompt_ids, params, stop, drafter, spec, decode, res, logprobs, constraint):
        pass
    return res
