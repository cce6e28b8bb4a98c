"""gRPC servicer of the verifier: validate and convert a GenerateRequest, run the turn, convert
the chunks back. Domain errors map to status codes in `_status_for` (one place)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc

from specmesh.convert import sampling_from_pb, structured_from_pb
from specmesh.engine import SpecConfig, StopConditions
from specmesh.limits import MAX_DEPTH, MAX_STOP_STRINGS, MAX_TREE_NODES
from specmesh.logprobs import check_logprobs, logprob_to_pb
from specmesh.tree import InvalidTreeError
from specmesh.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_service.sessions import SessionBusyError
from verifier_service.tp_group import TPGroupError
from verifier_service.turns import Outcome, Turn, Verifier

MAX_SESSION_ID = 320  # the router allows 256 and prefixes "<key id>/" (router.auth.scoped_session)


def _status_for(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, TPGroupError):
        return grpc.StatusCode.UNAVAILABLE  # a tensor-parallel rank died: this verifier is out
    if isinstance(exc, SessionBusyError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, (ValueError, InvalidTreeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


class DrafterGate:
    """Which drafter a request may make this verifier dial (`GenerateRequest.drafter_address`): its
    own --drafter, those in --drafter-allow (HOST:PORT, or HOST:* for any port of HOST) and, with a
    registry (--redis-url), any address that holds a live drafter registration there (answers kept
    CACHE_S). Anything else is refused, so a caller cannot make the verifier dial an arbitrary
    host:port; a registry that cannot be read refuses too."""

    CACHE_S = 5.0

    def __init__(self, own: str, allow: tuple[str, ...], redis_url: str) -> None:
        self.fixed = {a for a in (own, *allow) if a and not a.endswith(":*")}
        self.hosts = {a[:-2] for a in allow if a.endswith(":*")}
        self.redis_url = redis_url
        self._client = None
        self._seen: dict[str, tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def check(self, address: str) -> None:
        """ValueError naming drafter_address unless `address` may be dialled."""
        if address in self.fixed or address.rpartition(":")[0] in self.hosts:
            return
        if not self.redis_url:
            raise ValueError(f"drafter_address: {address!r} is not this verifier's --drafter nor in --drafter-allow")
        now = time.monotonic()
        with self._lock:
            hit = self._seen.get(address)
        if hit is None or now - hit[0] > self.CACHE_S:
            import redis
            from specmesh.registry import Role, registered_role

            try:
                if self._client is None:
                    self._client = redis.Redis.from_url(self.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
                hit = (now, registered_role(self._client, address) == Role.DRAFTER)
            except redis.RedisError as e:
                raise ValueError(f"drafter_address: the registry cannot confirm {address!r}: {e}") from e
            with self._lock:
                if len(self._seen) > 4096:
                    self._seen.clear()
                self._seen[address] = hit
        if not hit[1]:
            raise ValueError(f"drafter_address: {address!r} is not a registered drafter, this verifier's --drafter "
                             "or in --drafter-allow")


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, verifier: Verifier) -> None:
        self.v = verifier
        cfg = verifier.cfg
        self.gate = DrafterGate(cfg.drafter, cfg.drafter_allow, cfg.redis_url)

    def to_turn(self, req: verifier_pb2.GenerateRequest) -> Turn:
        cfg = self.v.cfg
        if len(req.session_id) > MAX_SESSION_ID:
            raise ValueError(f"session_id: longer than {MAX_SESSION_ID} characters")
        kind = req.WhichOneof("input")
        new_ids = list(req.token_ids.ids) if kind == "token_ids" else []
        if kind == "text":
            new_ids = self.v.tokenizer.encode(req.text, add_special_tokens=False)
        params = sampling_from_pb(req.sampling)
        params.validate()
        params.check_vocab(self.v.vocab_size)
        if req.max_tokens == 0 or req.max_tokens > cfg.max_new_tokens:
            raise ValueError(f"max_tokens: must be in [1, {cfg.max_new_tokens}], got {req.max_tokens}")
        if len(req.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings")
        self.v.check_ids(list(req.stop_token_ids), "stop_token_ids")
        stop_ids = frozenset(req.stop_token_ids) | (frozenset() if req.ignore_eos else self.v.eos_ids)
        stop = StopConditions(req.max_tokens, stop_ids, tuple(req.stop))
        stop.validate()
        o = req.speculation
        if req.drafter_address and not o.disabled:
            self.gate.check(req.drafter_address)
        spec = None
        if not o.disabled:
            # a seeded request must not depend on timing: a shape planned from measured costs does,
            # so its caps are its fixed shape
            spec = SpecConfig(o.budget or cfg.budget, o.depth or cfg.depth, o.fixed or params.seed is not None)
            if not 1 <= spec.budget <= MAX_TREE_NODES:
                raise ValueError(f"speculation.budget: must be in [1, {MAX_TREE_NODES}], got {spec.budget}")
            if not 1 <= spec.depth <= MAX_DEPTH:
                raise ValueError(f"speculation.depth: must be in [1, {MAX_DEPTH}], got {spec.depth}")
        if o.draft_deadline_s < 0 or o.draft_deadline_s > 60:
            raise ValueError(f"speculation.draft_deadline_s: must be in [0, 60], got {o.draft_deadline_s}")
        logprobs = req.logprobs if req.HasField("logprobs") else None
        check_logprobs(logprobs)
        if req.prompt_logprobs and logprobs is None:
            raise ValueError("prompt_logprobs: needs logprobs (the alternatives per token) set")
        return Turn(
            session_id=req.session_id, new_ids=new_ids, params=params, stop=stop,
            drafter=req.drafter_address or cfg.drafter, spec=spec,
            # a seeded request must not depend on timing: whether a predraft hits does, so it drafts in turn
            pipelined=cfg.pipelines(req.drafter_address or cfg.drafter) and not o.no_pipelining and params.seed is None,
            shares_cores=cfg.shares_cores(req.drafter_address or cfg.drafter),
            # an explicit deadline is kept as asked; else the configured one caps a derived one (not
            # for a seeded request: a derived deadline follows timing)
            deadline_s=o.draft_deadline_s or cfg.draft_deadline_s,
            derive_deadline=not o.draft_deadline_s and params.seed is None,
            history=list(req.history.ids) if req.HasField("history") else None,
            logprobs=logprobs, prompt_logprobs=req.prompt_logprobs, resumed_output=req.resumed_output_tokens,
            structured=structured_from_pb(req.structured) if req.HasField("structured") else None,
        )

    def Generate(self, request, context):
        out = Outcome()
        try:
            turn = self.to_turn(request)
            for chunks in run_ahead(self.v.run(turn, context.is_active, out)):
                ids = [t for c in chunks for t in c.token_ids]
                text = "".join(c.text for c in chunks)
                lps = [logprob_to_pb(lp) for c in chunks for lp in c.logprobs]
                prompt = [logprob_to_pb(lp) for c in chunks for lp in c.prompt_logprobs]
                yield verifier_pb2.GenerateResponse(chunk=verifier_pb2.Chunk(token_ids=ids, text=text, logprobs=lps,
                                                                             prompt_logprobs=prompt))
        except (ValueError, SessionBusyError, TPGroupError) as e:
            context.abort(_status_for(e), str(e))
        s = out.result.stats
        total = max(s.total_s, 1e-9)
        yield verifier_pb2.GenerateResponse(complete=verifier_pb2.Complete(
            finish_reason=out.result.finish_reason,
            usage=verifier_pb2.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=s.new_tokens,
                                     cached_prompt_tokens=out.cached_prompt_tokens),
            speculation=common_pb2.SpeculationStats(
                steps=s.steps, drafted_tokens=s.drafted_tokens, accepted_tokens=s.accepted_tokens,
                acceptance_rate=s.acceptance_rate, tokens_per_step=s.tokens_per_step,
                rejected_trees=s.rejected_trees, drafter_timeouts=out.timeouts,
                verify_idle_fraction=s.draft_s / total, predraft_hits=out.predraft_hits,
                draft_s=s.draft_s, verify_s=s.verify_s, plain_steps=out.plain_steps),
        ))

    def CloseSession(self, request, context):
        return verifier_pb2.CloseSessionResponse(existed=self.v.sessions.drop(request.session_id))


_END = object()


def run_ahead(it: Iterator) -> Iterator[list]:
    """Run `it` in a thread of its own, started now, and yield what it produced since the last
    yield (one or more items, in order): the turn's next step runs while gRPC sends this one's
    chunk, instead of waiting for the send to complete (a sync server's streaming send blocks
    until the transport took the message). Its exception is raised here after the items before
    it; closing this generator (the client went away) stops `it` at its next item, closes it in
    its own thread and waits for that."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in it:
                q.put(item)
                if stop.is_set():
                    break
        except BaseException as e:  # handed to the consumer, raised there
            q.put(_Raised(e))
        finally:
            if hasattr(it, "close"):
                it.close()
            q.put(_END)

    thread = threading.Thread(target=produce, name="turn", daemon=True)
    thread.start()
    return _drain(q, stop, thread)


class _Raised:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _drain(q: queue.SimpleQueue, stop: threading.Event, thread: threading.Thread) -> Iterator[list]:
    try:
        while True:
            batch = [q.get()]
            while not q.empty():
                batch.append(q.get())
            items = [x for x in batch if x is not _END and not isinstance(x, _Raised)]
            if items:
                yield items
            for x in batch:
                if isinstance(x, _Raised):
                    raise x.exc
            if batch[-1] is _END:
                return
    finally:
        # The turn never outlives the RPC: it calls into the RPC's context (is_active), which gRPC
        # tears down once the handler returns. A cancelled turn stops within a step.
        stop.set()
        thread.join()
