"""One turn of one session on this verifier: place the new tokens in the session's KV cache,
run the speculation loop with the session's drafter, stream tokens and text deltas.

Transport-free: the servicer converts protobuf to a `Turn` and `Event`s back to protobuf.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from specmesh.batching import BatchingTarget
from specmesh.costs import StepTable
from specmesh.engine import GenerationResult, SpecConfig, StopConditions, TargetSession, run_turn, target_steps
from specmesh.grammar import Grammars, GrammarSpec
from specmesh.limits import check_ids
from specmesh.logprobs import TokenLogprob
from specmesh.sampling import SamplingParams, make_generator
from specmesh.text import TextStream, eos_ids
from verifier_service.config import VerifierConfig
from verifier_service.drafter_link import DrafterLink, LinkPool, RemoteDrafts
from verifier_service.sessions import Session, SessionStore


@dataclass(frozen=True)
class Turn:
    session_id: str                  # "" = one-shot
    new_ids: list[int]
    params: SamplingParams
    stop: StopConditions
    drafter: str                     # host:port or ""
    spec: SpecConfig | None          # None = no speculation
    pipelined: bool
    deadline_s: float                # the longest wait for a tree
    history: list[int] | None = None  # full history to rebuild from (failover)
    derive_deadline: bool = False    # wait only as long as the drafter's measured answers make likely
    logprobs: int | None = None      # alternatives per token of the generated tokens' logprobs; None = none
    prompt_logprobs: bool = False    # also the input tokens' (needs logprobs)
    resumed_output: int = 0          # the history's last tokens that are this turn's output (failover)
    structured: GrammarSpec | None = None  # the grammar the output must match
    shares_cores: bool = False       # the drafter runs here and this verifier's threads take every core


@dataclass
class Outcome:
    finish_reason: str = "length"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    result: GenerationResult = field(default_factory=GenerationResult)
    timeouts: int = 0
    predraft_hits: int = 0
    plain_steps: int = 0


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)         # one per token id, when asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of the input tokens, once


class Verifier:
    def __init__(self, cfg: VerifierConfig, model, tokenizer) -> None:
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.eos_ids = eos_ids(tokenizer)
        self.sessions = SessionStore(cfg.max_sessions)
        self.grammars = Grammars(tokenizer, self.vocab_size)  # structured outputs
        self.links = LinkPool(cfg.max_message_bytes, cfg.reconnect_s, cfg.peer_tls)
        # this verifier's step by rows, measured here (or kept from an earlier start on this machine:
        # `engine.target_steps`) and corrected by its live steps: drafters plan their trees against
        # it (a batching wrapper's own model: one session's steps are its forwards, uncounted)
        self.steps = StepTable(target_steps(model.model if isinstance(model, BatchingTarget) else model))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_ids(self, ids: list[int], name: str) -> None:
        check_ids(ids, self.vocab_size, name)

    def run(self, turn: Turn, is_active: Callable[[], bool], out: Outcome) -> Iterator[Chunk]:
        """Yield chunks of the turn; fill `out`. Raises ValueError / SessionBusyError on bad input."""
        self.check_ids(turn.new_ids, "token_ids")
        if turn.history is not None:
            self.check_ids(turn.history, "history")
        context_len = len(turn.history or []) + len(turn.new_ids)
        if turn.session_id and turn.history is None:
            pass  # the held session's length is checked below
        elif context_len == 0:
            raise ValueError("input: a turn needs at least one token")
        if turn.resumed_output > len(turn.history or []):
            raise ValueError(f"resumed_output_tokens: {turn.resumed_output} exceed the history's "
                             f"{len(turn.history or [])} tokens")
        if context_len > self.cfg.max_context_tokens:
            raise ValueError(f"input: {context_len} tokens exceed max_context_tokens {self.cfg.max_context_tokens}")
        constraint = None if turn.structured is None else self.grammars.constraint(turn.structured)
        if constraint is not None and turn.resumed_output:  # the grammar has read the output so far
            try:
                constraint.add(turn.history[len(turn.history) - turn.resumed_output:])
            except RuntimeError as exc:
                raise ValueError(f"resumed_output_tokens: the output so far does not match the grammar: {exc}") from exc
        sid = turn.session_id or f"oneshot-{uuid.uuid4().hex}"
        session = self.sessions.acquire(sid)
        session.named = bool(turn.session_id)
        session.drafter = "" if turn.drafter == self.cfg.drafter else turn.drafter
        try:
            target, prompt_lps = self._place(session, turn, out, sid)
            if prompt_lps:
                yield Chunk([], "", prompt_logprobs=prompt_lps)
            yield from self._speculate(session, sid, target, turn, is_active, out, constraint)
        finally:
            self.sessions.release(session)
            if not turn.session_id:
                self.sessions.drop(sid)

    def _place(self, session, turn: Turn, out: Outcome, sid: str) -> tuple[TargetSession, list[TokenLogprob] | None]:
        """The session's target holding the turn's context, and the input tokens' logprobs when
        the turn asked for them."""
        # 1. reuse the held KV cache where it matches (the history is what it holds, or a prefix
        # of it: a regenerated answer, the next of n samples), else rebuild from the history
        lps = turn.logprobs if turn.prompt_logprobs else None
        t = session.target
        if turn.history and t is not None and t.tokens[:len(turn.history)] == turn.history:
            if len(t.tokens) > len(turn.history):
                t.rollback(len(turn.history))
        elif turn.history is not None and (t is None or t.tokens != turn.history):
            t = session.target = None
        if t is None:
            context = (turn.history or []) + turn.new_ids
            if not context:
                raise ValueError("input: unknown session and no tokens to start it")
            early = self._open_early(session, sid, turn, context)
            try:
                # the target keeps its features for a feature drafter (EAGLE-style) from the start
                session.target = TargetSession(self.model, context, features=self._feature_dim(turn) > 0,
                                               prompt_logprobs=lps)
            except BaseException:
                if early:
                    session.drafts.close()
                    session.drafts = None
                raise
            out.prompt_tokens = len(context)
            prompt = session.target.prompt_logprobs
            return session.target, None if prompt is None else prompt[len(context) - len(turn.new_ids):]
        if len(t.tokens) + len(turn.new_ids) > self.cfg.max_context_tokens:
            raise ValueError(f"input: session would hold more than max_context_tokens {self.cfg.max_context_tokens}")
        out.cached_prompt_tokens = len(t.tokens)
        prompt = t.extend(turn.new_ids, lps)
        out.prompt_tokens = len(t.tokens)
        return t, prompt

    def _open_early(self, session: Session, sid: str, turn: Turn, context: list[int]) -> bool:
        """Open the turn's drafter session on `context` before the target's prefill, where the
        drafter drafts on cores of its own (a pipelined turn, not on this verifier's cores) and needs
        no target features: its prefill and first tree then run beside the target's prefill, not
        after it, and the first token comes that much sooner. True when it did (`_drafts` takes it)."""
        link = self._link(turn)
        if link is None or link.feature_dim > 0 or not turn.pipelined or turn.shares_cores:
            return False
        if session.drafts is not None:
            session.drafts.close()
        session.drafts = self._new_drafts(link, sid, None, turn, context)
        return True

    def _new_drafts(self, link: DrafterLink, sid: str, target: TargetSession | None, turn: Turn,
                    context: list[int] | None = None) -> RemoteDrafts:
        """A fresh drafter session for the turn (OpenSession on `target`'s tokens, or on `context`
        before the target exists)."""
        return RemoteDrafts(link, sid, target, turn.params, turn.spec, turn.pipelined, turn.deadline_s,
                            turn.derive_deadline, self.steps, self._grammar(turn), turn.shares_cores, context)

    def _link(self, turn: Turn) -> DrafterLink | None:
        return self.links.get(turn.drafter) if (turn.spec is not None and turn.drafter) else None

    @staticmethod
    def _grammar(turn: Turn) -> GrammarSpec | None:
        """The grammar the drafter gets: the turn's, except for a turn resumed after a failover
        (`_drafts`)."""
        return None if turn.resumed_output else turn.structured

    def _feature_dim(self, turn: Turn) -> int:
        link = self._link(turn)
        return 0 if link is None else link.feature_dim

    def _drafts(self, session: Session, sid: str, target: TargetSession, turn: Turn) -> RemoteDrafts | None:
        """The turn's drafter session: the one the session holds, told only the new tokens
        (ExtendSession), else a fresh one (OpenSession with the whole context), else none. A
        feature drafter needs a target session that kept its features (one started with such a
        drafter); without them, and for a feature width other than the target's hidden size, the
        turn runs without speculation. The drafter gets the turn's grammar, except for a turn resumed
        after a failover (its grammar would begin at the drafter's context end, after the output so
        far): such a turn drafts unguided, verification still enforces the grammar."""
        link = self._link(turn)
        held = session.drafts
        if held is not None and held.target is None:  # opened for this turn before the prefill
            held.target = target
            return held
        if held is not None and held.resume(link, target, turn.params, turn.spec, turn.pipelined, turn.deadline_s,
                                              turn.derive_deadline, self._grammar(turn)):
            return held
        if held is not None:
            held.close()
        dim = 0 if link is None else link.feature_dim
        if dim and (target.features is None or dim != self.model.config.hidden_size):
            link = None
        session.drafts = None if link is None else self._new_drafts(link, sid, target, turn)
        return session.drafts

    def _speculate(self, session: Session, sid: str, target: TargetSession, turn: Turn,
                   is_active: Callable[[], bool], out: Outcome, constraint=None) -> Iterator[Chunk]:
        params = turn.params
        generator = make_generator(params)
        source = self._drafts(session, sid, target, turn)
        res = out.result
        res.stats.prompt_tokens = out.prompt_tokens
        text = TextStream(self.decode, turn.stop.stop_strings)  # decodes each step's tokens, not the whole text
        t0 = time.perf_counter()
        try:
            for ids in run_turn(target, source, params, generator, turn.stop, self.decode, res, turn.logprobs,
                                turn.resumed_output, constraint):
                end = len(res.token_ids)  # `ids` are the last tokens of the turn so far
                yield Chunk(ids, text.push(ids), res.logprobs[end - len(ids):end] if turn.logprobs is not None else [])
                if not is_active():
                    res.finish_reason = "cancelled"
                    break
            out.finish_reason = res.finish_reason
            tail = text.finish()
            if tail:
                yield Chunk([], tail)
        finally:
            res.stats.total_s = time.perf_counter() - t0
            if isinstance(self.model, BatchingTarget):
                self.model.idle(target.cache)  # the turn is over: other sessions' batches go without it
            if source is not None:  # the drafter session stays with the session (closed with it)
                out.timeouts, out.predraft_hits, out.plain_steps = (source.timeouts, source.predraft_hits,
                                                                    source.plain_steps)

    def shutdown(self) -> None:
        self.links.shutdown()
