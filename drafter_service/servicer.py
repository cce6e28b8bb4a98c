"""The Drafter gRPC servicer: one bidirectional `Draft` stream per verifier connection, many
sessions multiplexed on it. Validate, convert, call `specmesh.drafters.predraft.DraftAhead`.

Protocol, as this service implements it:
- OpenSession -> DraftResponse{step=0, position=len(context), tree}. Opening an id that exists
  replaces that session (a verifier rebuilding it after a reconnect).
- CommitStep{step} must name the step of the tree last sent for the session. It appends
  accepted + [bonus] and answers with the tree for step + 1, rooted at the new position;
  predrafted=true when it came from the predraft (pipelining hit).
- OpenSession{push_predrafts} (pipelined sessions): each predraft goes out as soon as it is made,
  DraftResponse{step, ahead{accepted}, position, tree}. A CommitStep{took_predraft} says that the
  verifier took the tree for step + 1 from one of them: no answer, the session goes on from that
  tree (an error if the drafter has no such tree).
- ExtendSession{tokens, keep} keeps the first `keep` committed tokens (0 = all; the verifier
  ended its last turn inside a verified path), appends the tokens (a follow-up turn; the tree
  last sent is dropped unverified) and answers with a fresh tree for step = last step + 1:
  steps count the trees sent for a session, 0, 1, 2, ..., whatever caused them.
- CloseSession drops the session; no answer (unknown ids included).
- A drafter with a tokenizer announces `specmesh-grammar: llguidance` in the stream's initial
  metadata. OpenSession{structured} (and ExtendSession{structured} for a new turn) give the turn's
  grammar; its trees then hold only allowed nodes. ExtendSession{same_turn} (a plain run's tokens)
  keeps the turn's grammar. A grammar sent to a drafter without one, or that does not compile, is
  a bad request (`structured: ...`).
- A feature drafter (`specmesh.drafters.feature`) announces its feature size in the stream's
  initial metadata (`specmesh-feature-dim`, "0" for other drafters) and needs `features` in
  every open, extend and commit; a missing or mis-sized `features` is a bad request like any other.
- Any bad request for a session (unknown or evicted id, wrong step, token id outside the
  vocabulary (ngram: any id >= 0), budget outside [1, 64], depth outside [1, 16], bad sampling
  settings, empty context) -> DraftResponse{session_id, error="<field>: <message>"}, and the
  session is closed. The stream and the other sessions go on untouched.
- Sessions belong to the service, not to a stream: a commit may come on another stream, and a
  stream that ends leaves its sessions to the LRU / idle eviction.

Requests are read by a separate thread into a queue, so that the stream's loop sees them
promptly: it answers requests first, and predrafts (one tree at a time, oldest answer first; a
session wanting several goes to the back after each) only while no request waits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

import grpc

from drafter_service.sessions import SessionStore
from specmesh.convert import (FEATURE_DIM_KEY, GRAMMAR_KEY, features_from_pb, sampling_from_pb, structured_from_pb,
                              tree_to_pb)
from specmesh.costs import Costs
from specmesh.drafters.base import Drafter
from specmesh.drafters.predraft import DraftAhead, StepTree
from specmesh.limits import MAX_DEPTH, MAX_TREE_NODES, check_ids
from specmesh.planner import Acceptance
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)

_END = object()  # end of the request stream


class RequestError(ValueError):
    """A bad request for one session; the message starts with the offending field."""


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """specmesh.v1.Drafter over a shared SessionStore; see the module docstring for the protocol."""

    def __init__(self, drafter: Drafter, store: SessionStore, vocab_size: int | None,
                 costs: Costs | None = None, recent: Acceptance | None = None,
                 max_context_tokens: int | None = None, grammars=None) -> None:
        """`vocab_size`: token ids must be below it; None (ngram) accepts any id >= 0. `costs`,
        `recent`: what this process measured (drafting; per verifier, `Costs.of_verifier`: its
        verifications reported, the link, step periods) and the acceptance of its recent sessions,
        shared by every session's planner. `max_context_tokens`:
        a request that would make a session hold more is refused (the session is closed).
        `grammars`: a `specmesh.grammar.Grammars` over the target's tokenizer, or None (no pruning)."""
        self.grammars = grammars
        self.max_context_tokens = max_context_tokens
        self.drafter = drafter
        self.store = store
        self.vocab_size = vocab_size
        self.costs = costs if costs is not None else Costs()
        self.recent = recent if recent is not None else Acceptance()
        self.feature_dim = drafter.feature_dim if drafter.needs_features else 0

    def Draft(self, request_iterator: Iterator[drafter_pb2.DrafterRequest],
              context: grpc.ServicerContext) -> Iterator[drafter_pb2.DraftResponse]:
        meta = [(FEATURE_DIM_KEY, str(self.feature_dim))] + ([(GRAMMAR_KEY, "llguidance")] if self.grammars else [])
        context.send_initial_metadata(tuple(meta))
        inbox: queue.Queue = queue.Queue()
        context.add_callback(lambda: inbox.put(_END))
        threading.Thread(target=_pump, args=(request_iterator, inbox), daemon=True,
                         name="drafter-requests").start()
        ahead: OrderedDict[str, None] = OrderedDict()  # sessions to predraft, oldest answer first
        while True:
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                if ahead:
                    sid, _ = ahead.popitem(last=False)
                    out, more = self._predraft(sid)
                    yield from out
                    if more:
                        ahead[sid] = None  # its next predraft after the other sessions' first
                    continue
                item = inbox.get()
            if item is _END:
                return
            req, arrived = item
            resp, session = self.handle(req, arrived)
            if resp is not None:
                yield resp
            if session is not None and session.pipelined:
                ahead.pop(req.session_id, None)
                ahead[req.session_id] = None

    def handle(self, req: drafter_pb2.DrafterRequest,
               arrived: float | None = None) -> tuple[drafter_pb2.DraftResponse | None, DraftAhead | None]:
        """Answer one request that reached the service at `arrived` (perf_counter; None: now):
        (response or None, the session answered for predrafting)."""
        sid = req.session_id
        kind = req.WhichOneof("kind")
        try:
            if not sid:
                raise RequestError("session_id: must not be empty")
            if kind == "close":
                self.store.pop(sid)
                return None, None
            if kind == "open":
                session, step = self._open(sid, req.open)
            elif kind == "commit":
                c = req.commit
                session = self._session(sid)
                _check_shape(c.budget, c.depth)
                self._check_tokens("accepted", c.accepted)
                self._check_tokens("bonus", [c.bonus])
                self._check_length("accepted", session.position + len(c.accepted) + 1)
                step = session.commit(c.step, list(c.accepted), c.bonus, c.budget, c.depth,
                                      self._features(c.features, len(c.accepted) + 1), c.took_predraft, arrived,
                                      c.verify_s)
                if c.took_predraft:
                    return None, session  # the verifier holds that tree already
            elif kind == "extend":
                e = req.extend
                session = self._session(sid)
                _check_shape(e.budget, e.depth)
                self._check_tokens("tokens", e.tokens)
                self._check_length("tokens", (e.keep or session.position) + len(e.tokens))
                grammar = None if e.same_turn else self._grammar(e)
                step = session.extend(list(e.tokens), e.budget, e.depth, e.keep,
                                      self._features(e.features, len(e.tokens)), grammar, e.same_turn, arrived)
            else:
                raise RequestError("kind: one of open, extend, commit or close is required")
        except ValueError as exc:
            return self._fail(sid, str(exc)), None
        except Exception as exc:  # a drafter bug must not take the stream and its other sessions down
            log.exception("session %r: %s request failed", sid, kind)
            return self._fail(sid, f"internal: {type(exc).__name__}: {exc}"), None
        return _response(sid, step), session

    def _open(self, sid: str, o: drafter_pb2.OpenSession) -> tuple[DraftAhead, StepTree]:
        self.store.pop(sid)  # opening an existing id replaces it
        params = sampling_from_pb(o.sampling)
        params.validate()
        _check_shape(o.budget, o.depth)
        if not o.context:
            raise RequestError("context: must hold at least one token")
        self._check_tokens("context", o.context)
        self._check_length("context", len(o.context))
        context = list(o.context)
        features = self._features(o.features, len(context) - 1)
        if any(pt.rows < 1 or not pt.seconds > 0 for pt in o.verify_cost):
            raise RequestError("verify_cost: every point needs rows >= 1 and seconds > 0")
        costs = self.costs.of_verifier(o.verifier)  # the drafting costs shared, the verifier's its own
        costs.set_verify_cost([(pt.rows, pt.seconds) for pt in o.verify_cost])
        grammar = self._grammar(o)
        session = DraftAhead(self.drafter.open(context, features), len(context), params, o.pipelined,
                             push=o.pipelined and o.push_predrafts, costs=costs, recent=self.recent,
                             fixed=o.fixed_shape, grammar=grammar, sharing=self.store.busy,
                             shares_cores=o.shares_cores)
        try:
            step = session.first(o.budget, o.depth)
        except BaseException:
            session.close()
            raise
        self.store.put(sid, session)
        return session, step

    def _grammar(self, msg):
        """The turn's grammar (a `grammar.Guide`) from an open or extend message (None when it has
        none)."""
        if not msg.HasField("structured"):
            return None
        if self.grammars is None:
            raise RequestError("structured: this drafter has no tokenizer to follow a grammar with "
                               "(it announces none; start it with --tokenizer)")
        return self.grammars.guide(structured_from_pb(msg.structured))

    def _session(self, sid: str) -> DraftAhead:
        session = self.store.get(sid)
        if session is None:
            raise RequestError(f"session_id: unknown session {sid!r} (never opened, closed or evicted)")
        return session

    def _predraft(self, sid: str) -> tuple[list[drafter_pb2.DraftResponse], bool]:
        """One unit of predrafting for a session: (responses to send: the predrafts made when the
        session pushes them, or an error; whether it wants another)."""
        session = self.store.get(sid, touch=False)
        if session is None:
            return [], False
        try:
            more = session.predraft() and session.wants_predraft
        except ValueError as exc:  # closed or evicted meanwhile: its next request says so
            return ([] if session.closed else [self._fail(sid, str(exc))]), False
        except Exception as exc:
            log.exception("session %r: predraft failed", sid)
            return [self._fail(sid, f"internal: predraft failed: {type(exc).__name__}: {exc}")], False
        out = [drafter_pb2.DraftResponse(session_id=sid, step=p.step, position=p.position, tree=tree_to_pb(p.tree),
                                         ahead=drafter_pb2.Ahead(accepted=p.accepted, depth=p.depth))
               for p in session.take_fresh()] if session.push else []
        return out, more

    def _fail(self, sid: str, error: str) -> drafter_pb2.DraftResponse:
        if sid:
            self.store.pop(sid)
        return drafter_pb2.DraftResponse(session_id=sid, error=error)

    def _features(self, data: bytes, rows: int):
        """The target features of a request, for a feature drafter (None for the others)."""
        return features_from_pb(data, rows, self.feature_dim) if self.feature_dim else None

    def _check_length(self, field: str, tokens: int) -> None:
        if self.max_context_tokens is not None and tokens > self.max_context_tokens:
            raise RequestError(f"{field}: the session would hold {tokens} tokens, more than this drafter's "
                               f"--max-context-tokens {self.max_context_tokens}")

    def _check_tokens(self, field: str, ids) -> None:
        check_ids(ids, self.vocab_size, field)


def _check_shape(budget: int, depth: int) -> None:
    if not 1 <= budget <= MAX_TREE_NODES:
        raise RequestError(f"budget: must be in [1, {MAX_TREE_NODES}], got {budget}")
    if not 1 <= depth <= MAX_DEPTH:
        raise RequestError(f"depth: must be in [1, {MAX_DEPTH}], got {depth}")


def _response(sid: str, st: StepTree) -> drafter_pb2.DraftResponse:
    return drafter_pb2.DraftResponse(session_id=sid, step=st.step, position=st.position,
                                     tree=tree_to_pb(st.tree), predrafted=st.predrafted, plain_steps=st.plain)


def _pump(requests: Iterator[drafter_pb2.DrafterRequest], inbox: queue.Queue) -> None:
    """Move requests into the inbox as they arrive, with the time they did (pacing measures from
    it: a request that waits for a predraft in progress arrived before it is handled); _END when
    the stream ends or breaks."""
    try:
        for req in requests:
            inbox.put((req, time.perf_counter()))
    except grpc.RpcError as exc:  # cancelled or broken by the client: the stream just ends
        log.debug("request stream ended: %s", exc)
    finally:
        inbox.put(_END)
