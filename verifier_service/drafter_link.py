"""The verifier's side of the drafter protocol: one bidirectional `Draft` stream per drafter
address, multiplexing sessions, and `RemoteDrafts`, the engine's TreeSource over it.

Plain runs: when the drafter's planner predicts that not speculating is faster, it sends an empty
tree asking for a run of one-row steps (`DraftResponse.plain_steps`). `RemoteDrafts` takes them
without waiting for trees and sends their tokens in one ExtendSession at the run's end (or with
the next turn's), so a run pays one round trip and the drafter feeds its tokens in one call.

Failure semantics: a drafter that is dead, slow or wrong only costs speed. `next_tree` waits at
most the step deadline and then returns an empty tree (the verifier decodes one token without
speculation); the commit of that step is still sent, so the drafter stays in step (a late tree
for an old step is dropped here). A broken stream marks the link dead: every waiter wakes at once,
and `LinkPool` opens a new stream after `reconnect_s`. Links are plaintext, or TLS / mTLS as the
pool's `PeerTls` says (a drafter refusing the handshake is a dead link like any other).

Grammars: a drafter that announces a grammar engine in its initial metadata (`grammar`) is sent
each turn's grammar with the open or extend that starts the turn, and prunes its trees to it.

Feature drafters: the drafter's initial metadata says how wide the target features it takes are
(`feature_dim`, 0 for none); for such a drafter every open/extend/commit carries the target
session's features (`TargetSession(features=True)`, which the verifier turns on for sessions
started with such a drafter).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid

import grpc

from specmesh.convert import FEATURE_DIM_KEY, GRAMMAR_KEY, features_to_pb, sampling_to_pb, structured_to_pb, tree_from_pb
from specmesh.costs import StepTable
from specmesh.drafters.pick import next_tree_from
from specmesh.engine import SpecConfig, TargetSession
from specmesh.grammar import GrammarSpec
from specmesh.limits import MAX_DEPTH
from specmesh.planner import PREDRAFT_MAX_BUDGET
from specmesh.sampling import SamplingParams, VerifyResult
from specmesh.text import common_prefix
from specmesh.tls import PLAINTEXT_PEER, PeerTls, peer_channel
from specmesh.tree import DraftTree, InvalidTreeError, validate_tree
from specmesh.v1 import drafter_pb2 as pb
from specmesh.v1 import drafter_pb2_grpc

_DEAD = object()  # wakes waiters of a broken link
METADATA_WAIT_S = 5.0  # how long a new link waits for the drafter's initial metadata
MAX_PUSHED = 64  # pushed predrafts kept per session, at most (a drafter cannot fill memory)
DEADLINE_MARGIN = 3.0  # a derived deadline: this many times the slowest recent wait for a tree ...
DEADLINE_FLOOR_S = 0.02  # ... plus this (scheduling noise)
DEADLINE_DECAY = 0.95  # per tree, how fast an old slow wait is forgotten
MAX_PLAIN_RUN = 64  # one-row steps a drafter may ask for at once, at most


class DrafterLink:
    def __init__(self, address: str, max_message_bytes: int, peer: PeerTls = PLAINTEXT_PEER) -> None:
        self.address = address
        self.alive = True
        self.failed_at = 0.0
        self._feature_dim = 0
        self._grammar = False
        self._announced = threading.Event()  # the initial metadata arrived, or the link died
        self._send: queue.Queue = queue.Queue()
        self._inbox: dict[str, queue.Queue] = {}
        self._ahead: dict[str, dict[tuple[int, tuple[int, ...]], pb.DraftResponse]] = {}  # pushed predrafts
        self._lock = threading.Lock()
        opts = [("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes)]
        self._channel = peer_channel(address, peer, opts)
        call = drafter_pb2_grpc.DrafterStub(self._channel).Draft(self._requests())
        threading.Thread(target=self._read, args=(call,), daemon=True, name=f"drafter-{address}").start()

    def _requests(self):
        while True:
            item = self._send.get()
            if item is None:
                return
            yield item

    @property
    def feature_dim(self) -> int:
        """Width of the target features the drafter takes (0: none, or not known in time)."""
        self._announced.wait(METADATA_WAIT_S)
        return self._feature_dim

    @property
    def grammar(self) -> bool:
        """The drafter prunes its trees to a turn's grammar (False: not, or not known in time)."""
        self._announced.wait(METADATA_WAIT_S)
        return self._grammar

    def _read(self, call) -> None:
        try:
            meta = dict(call.initial_metadata())
            try:
                self._feature_dim = max(0, int(meta.get(FEATURE_DIM_KEY, "0")))
            except ValueError:
                self._feature_dim = 0
            self._grammar = bool(meta.get(GRAMMAR_KEY))
            self._announced.set()
            for resp in call:
                with self._lock:
                    if resp.HasField("ahead"):  # a pushed predraft: kept until its step's commit
                        pushed = self._ahead.get(resp.session_id)
                        if pushed is not None and len(pushed) < MAX_PUSHED:
                            pushed[(resp.step, tuple(resp.ahead.accepted))] = resp
                        continue
                    box = self._inbox.get(resp.session_id)
                if box is not None:
                    box.put(resp)
        except grpc.RpcError:
            pass  # the drafter went away; speculation stops for its sessions, output does not change
        self._fail()

    def _fail(self) -> None:
        with self._lock:
            self.alive = False
            self.failed_at = time.monotonic()
            boxes = list(self._inbox.values())
        self._announced.set()
        for box in boxes:
            box.put(_DEAD)

    def open(self, session_id: str, msg: pb.OpenSession) -> None:
        with self._lock:
            self._inbox[session_id] = queue.Queue()
            self._ahead[session_id] = {}
        self._send.put(pb.DrafterRequest(session_id=session_id, open=msg))

    def take_pushed(self, session_id: str, step: int, accepted: list[int]) -> pb.DraftResponse | None:
        """The predraft pushed for this outcome of the tree of `step`, if it came; every predraft
        pushed for `step` or earlier is dropped."""
        with self._lock:
            pushed = self._ahead.get(session_id)
            if not pushed:
                return None
            found = pushed.get((step, tuple(accepted)))
            for key in [k for k in pushed if k[0] <= step]:
                del pushed[key]
            return found

    def commit(self, session_id: str, msg: pb.CommitStep) -> None:
        self._send.put(pb.DrafterRequest(session_id=session_id, commit=msg))

    def extend(self, session_id: str, msg: pb.ExtendSession) -> None:
        self._send.put(pb.DrafterRequest(session_id=session_id, extend=msg))

    def close_session(self, session_id: str) -> None:
        with self._lock:
            self._inbox.pop(session_id, None)
            self._ahead.pop(session_id, None)
        if self.alive:
            self._send.put(pb.DrafterRequest(session_id=session_id, close=pb.CloseSession()))

    def answered(self, session_id: str) -> bool:
        """Whether an answer for the session is waiting to be taken."""
        with self._lock:
            box = self._inbox.get(session_id)
        return box is not None and not box.empty()

    def wait_tree(self, session_id: str, step: int, timeout_s: float) -> pb.DraftResponse | None:
        """The drafter's answer for `step`, or None if it does not come in time or the link died."""
        with self._lock:
            box = self._inbox.get(session_id)
        if box is None or not self.alive:
            return None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                resp = box.get(timeout=max(left, 0.0)) if left > 0 else box.get_nowait()
            except queue.Empty:
                return None
            if resp is _DEAD:
                return None
            if resp.error or resp.step == step:
                return resp
            # an answer for an older step that arrived after its deadline: drop it

    def shutdown(self) -> None:
        self._send.put(None)
        self._channel.close()


class LinkPool:
    """One live DrafterLink per address; a dead one is replaced after `reconnect_s`."""

    def __init__(self, max_message_bytes: int, reconnect_s: float, peer: PeerTls = PLAINTEXT_PEER) -> None:
        self._links: dict[str, DrafterLink] = {}
        self._lock = threading.Lock()
        self.max_message_bytes = max_message_bytes
        self.reconnect_s = reconnect_s
        self.peer = peer

    def get(self, address: str) -> DrafterLink | None:
        with self._lock:
            link = self._links.get(address)
            if link is not None and not link.alive:
                if time.monotonic() - link.failed_at < self.reconnect_s:
                    return None
                link.shutdown()
                link = None
            if link is None:
                link = self._links[address] = DrafterLink(address, self.max_message_bytes, self.peer)
            return link

    def shutdown(self) -> None:
        with self._lock:
            for link in self._links.values():
                link.shutdown()
            self._links.clear()


def derived_deadline(slowest_s: float | None, cap_s: float) -> float:
    """How long to wait for a tree: DEADLINE_MARGIN times the slowest recent wait for one that came
    (decaying; a wait that timed out counts as one that long: `RemoteDrafts.next_tree`), plus
    DEADLINE_FLOOR_S, at most `cap_s`; `cap_s` until a tree has come."""
    if slowest_s is None:
        return cap_s
    return min(cap_s, DEADLINE_MARGIN * slowest_s + DEADLINE_FLOOR_S)


class RemoteDrafts:
    """TreeSource for one session, drafted by a remote drafter. It outlives a turn: the verifier's
    session keeps it, and the next turn `resume`s it with an ExtendSession carrying only the new
    tokens (the drafter keeps its cache), or opens a fresh one when it cannot.

    `deadline_s`: the longest wait for a tree. With `derive_deadline`, a step waits at most what
    the drafter's measured answers make likely (`derived_deadline`), within it; a tree that missed
    its step is dropped, so a too-short wait only costs that step's speculation."""

    def __init__(self, link: DrafterLink, session_id: str, target: TargetSession | None, params: SamplingParams,
                 spec: SpecConfig, pipelined: bool, deadline_s: float, derive_deadline: bool = False,
                 steps: StepTable | None = None, structured: GrammarSpec | None = None,
                 shares_cores: bool = False, context: list[int] | None = None) -> None:
        """`target` None: opened on `context` before the target session exists (its prefill then runs
        beside the drafter's: `Verifier._open_early`); set `target` before the first tree is asked
        for. Only for a drafter that needs no target features."""
        self.link, self.session_id, self.spec, self.deadline_s = link, session_id, spec, deadline_s
        self.shares_cores = shares_cores  # told to the drafter at each open (OpenSession.shares_cores)
        self.structured = structured  # the turn's grammar
        self.steps = steps  # this verifier's step by rows: sent with each open, fed by this session's steps
        self.derive_deadline = derive_deadline
        self.slowest_s: float | None = None  # decaying maximum of the waits for trees that came
        self.params, self.pipelined = params, pipelined
        self.target = target  # whose features a feature drafter gets
        self.features = link.feature_dim > 0
        assert target is not None or (context is not None and not self.features)
        self.usable = True
        self.timeouts = 0
        self.predraft_hits = 0
        self.plain_steps = 0
        self._taken: DraftTree | None = None  # the next tree, taken from a pushed predraft
        self._run_left = 0  # one-row steps left in the plain run the drafter asked for (this one included)
        self._run: list[int] = []  # the run's committed tokens, not yet sent
        self._open(list(target.tokens if target is not None else context))

    def _features(self, first: int, count: int) -> bytes:
        """The target features pairing with committed tokens [first, first + count), for a feature drafter."""
        if not self.features:
            return b""
        return features_to_pb(self.target.features[first - 1:first - 1 + count])

    def _open(self, context: list[int]) -> None:
        # a fresh drafter-side key per drafter session: answers in flight for an earlier one never mix in
        self.sid = f"{self.session_id}/{uuid.uuid4().hex[:12]}"
        self.context = context  # the committed tokens the drafter holds
        self.step = 0
        self.resumed = False
        self._end_run()
        self.link.open(self.sid, pb.OpenSession(context=context, sampling=sampling_to_pb(self.params),
                                                  budget=self.spec.budget, depth=self.spec.depth,
                                                  pipelined=self.pipelined, push_predrafts=self.pipelined,
                                                  shares_cores=self.shares_cores,
                                                  fixed_shape=self.spec.fixed, verify_cost=self._step_cost(),
                                                  verifier=self.steps.key if self.steps else "",
                                                  features=self._features(1, len(context) - 1),
                                                  structured=self._structured()))

    def _step_cost(self) -> list:
        return [pb.CostPoint(rows=r, seconds=s) for r, s in (self.steps.points() if self.steps else ())]

    def _structured(self):
        """The turn's grammar for the drafter (None: it has none, or the drafter follows none)."""
        return structured_to_pb(self.structured) if self.structured is not None and self.link.grammar else None

    def resume(self, link: DrafterLink | None, target: TargetSession, params: SamplingParams, spec: SpecConfig,
               pipelined: bool, deadline_s: float, derive_deadline: bool = False,
               structured: GrammarSpec | None = None) -> bool:
        """Go on for a new turn whose committed tokens are `target.tokens` (and whose grammar is
        `structured`): send the drafter what it lacks
        (after the longest common prefix) and count the turn's stats afresh. False when the
        session cannot go on (another drafter or settings, a dead link, an error, nothing shared)."""
        if (link is not self.link or not (self.usable and link.alive)
                or (params, spec, pipelined) != (self.params, self.spec, self.pipelined)):
            return False
        if self.features and target.features is None:
            return False
        self.target = target
        tokens = target.tokens
        n = common_prefix(self.context, tokens)
        if n == 0:
            return False
        self.structured = structured
        keep = 0 if n == len(self.context) else n  # the last turn ended inside a verified path
        link.extend(self.sid, pb.ExtendSession(tokens=tokens[n:], budget=spec.budget, depth=spec.depth, keep=keep,
                                               features=self._features(n, len(tokens) - n),
                                               structured=self._structured()))
        self.context = list(tokens)
        self.step += 1  # the drafter answers with the step after the tree it sent last
        self._taken = None
        self._end_run()  # a run cut short by the turn's end: its tokens went in this extension
        self.deadline_s, self.timeouts, self.predraft_hits, self.plain_steps = deadline_s, 0, 0, 0
        self.derive_deadline = derive_deadline
        self.resumed = True
        return True

    def next_tree(self, budget: int) -> DraftTree:
        if not (self.usable and self.link.alive):
            return DraftTree.empty()
        if self._run_left:  # inside a plain run: no tree, no round trip
            return DraftTree.empty()
        if self._taken is not None:  # from a pushed predraft: no round trip
            tree, self._taken = self._taken, None
            self.predraft_hits += 1
            return tree
        wait = derived_deadline(self.slowest_s, self.deadline_s) if self.derive_deadline else self.deadline_s
        t = time.monotonic()
        ready = self.link.answered(self.sid)  # came before it was asked for: says nothing of how long one takes
        resp = self.link.wait_tree(self.sid, self.step, wait)
        if resp is not None and resp.error and self.resumed:
            # the drafter no longer holds the session (say, evicted while idle between turns):
            # open it afresh with the whole context, once
            self.link.close_session(self.sid)
            self._open(self.context)
            t = time.monotonic()
            resp = self.link.wait_tree(self.sid, self.step, self.deadline_s)
        self.resumed = False
        if resp is not None and not resp.error and not ready:
            waited = time.monotonic() - t
            self.slowest_s = waited if self.slowest_s is None else max(waited, DEADLINE_DECAY * self.slowest_s)
        if resp is None:
            self.timeouts += self.link.alive
            if self.derive_deadline and self.link.alive:
                # no tree in `wait`: one takes longer than that, so the next wait is a margin longer
                # (else a deadline derived from quick answers would stay below a slower drafter for good)
                self.slowest_s = max(self.slowest_s or 0.0, wait)
            return DraftTree.empty()
        if resp.error:
            self.usable = False  # the drafter closed this session: go on without speculation
            return DraftTree.empty()
        self.predraft_hits += resp.predrafted
        tree = tree_from_pb(resp.tree)
        if not tree.tokens and resp.plain_steps > 1:
            self._run_left = min(resp.plain_steps, MAX_PLAIN_RUN)
        return tree

    def committed(self, tree: DraftTree, result: VerifyResult, new_tokens: list[int],
                  features=None, verify_s: float = 0.0) -> None:
        if self.steps is not None and (not self.pipelined or self.shares_cores):  # no predraft beside it
            self.steps.add(1 + len(tree), verify_s)
        if self._run_left:
            self._run_left -= 1
            self.plain_steps += 1
            self._run.extend(new_tokens)
            if not self._run_left and self.usable and self.link.alive:
                self.link.extend(self.sid, pb.ExtendSession(tokens=self._run, budget=self.spec.budget,
                                                            depth=self.spec.depth, same_turn=True,
                                                            features=self._features(len(self.context), len(self._run))))
                self.context.extend(self._run)
                self.step += 1  # the drafter answers the extension with the tree of the next step
                self._end_run()
            return
        if self.usable and self.link.alive:
            accepted, bonus = new_tokens[:-1], new_tokens[-1]
            self._taken = self._from_pushed(accepted, bonus) if self.pipelined else None
            self.link.commit(self.sid, pb.CommitStep(step=self.step, accepted=accepted, bonus=bonus,
                                                     budget=self.spec.budget, depth=self.spec.depth,
                                                     features=features_to_pb(features) if self.features else b"",
                                                     took_predraft=self._taken is not None, verify_s=verify_s))
            self.context.extend(new_tokens)
        self.step += 1

    def _end_run(self) -> None:
        self._run_left, self._run = 0, []

    def _from_pushed(self, accepted: list[int], bonus: int) -> DraftTree | None:
        """The next tree from the predraft pushed for this outcome, picked as the drafter picks
        it (`next_tree_from`), or None (none came in time, none fits, or it is malformed)."""
        resp = self.link.take_pushed(self.sid, self.step, accepted)
        if resp is None:
            return None
        try:
            predraft = tree_from_pb(resp.tree)
            validate_tree(predraft, self.target.model.config.vocab_size, PREDRAFT_MAX_BUDGET, MAX_DEPTH + 1,
                          need_q=not self.params.greedy)
        except (InvalidTreeError, ValueError):
            return None
        depth = min(self.spec.depth, resp.ahead.depth or self.spec.depth)  # as planned by the drafter
        return next_tree_from(predraft, bonus, self.spec.budget, depth, self.params)

    def close(self) -> None:
        self.link.close_session(self.sid)
