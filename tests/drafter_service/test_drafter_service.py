"""The drafter service as a real process on 127.0.0.1: trees at the right positions, predraft hits
and misses, many sessions on one stream, errors confined to their session, LRU and idle
eviction, health and reflection, graceful exit on SIGTERM; with the ngram, oracle and model
drafters. The verifier's side is simulated here by committing outcomes chosen by the test."""

from __future__ import annotations

import json
import os
import queue
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from drafter_service.sessions import BUSY_S, SessionStore
from specmesh.convert import tree_from_pb
from specmesh.drafters import NgramDrafter
from specmesh.drafters.predraft import DraftAhead, main_path, pick_predrafted, predraft_shape, useful_depth
from specmesh.sampling import SamplingParams, make_generator
from specmesh.tree import DraftTree, children_of, validate_tree
from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams()
START_TIMEOUT_S = 120
REPLY_TIMEOUT_S = 30
VERIFY_S = 0.05  # simulated verification time: the drafter predrafts meanwhile
# the tiny model's tree takes ~2 ms: a verification ~3x that (with the likeliest outcome committed)
# makes predrafting pay by far more than the planner's OVERLAP_MARGIN (a commit that comes while a
# predraft runs waits for it); the test reports its whole step as the verification, as a verifier does
MODEL_VERIFY_S = 0.005


def _open(**fields) -> drafter_pb2.OpenSession:
    """OpenSession of a fixed shape unless said otherwise: these tests check the exact trees the
    protocol gives (the planner's choices are tested in tests/test_planner.py and below)."""
    fields.setdefault("fixed_shape", True)
    return drafter_pb2.OpenSession(**fields)


class Service:
    """`python -m drafter_service` on a free port; stopped by `stop()`."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.log = open(tmp / f"drafter_service_{os.getpid()}_{time.monotonic_ns()}.log", "w+")
        cmd = [sys.executable, "-m", "drafter_service", "--port", "0", "--threads", "1", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("drafter_service listening on "):
            self.stop()
            raise RuntimeError(f"service did not start: {line!r}\n{self.stderr()}")
        self.address = line.split()[-1]
        self.channel = grpc.insecure_channel(self.address)
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stream(self) -> "Stream":
        return Stream(self.stub)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "channel"):
            self.channel.close()
        self.log.close()


class Stream:
    """One Draft stream: `send` requests, `recv` responses (with a timeout)."""

    def __init__(self, stub: drafter_pb2_grpc.DrafterStub) -> None:
        self.requests: queue.Queue = queue.Queue()
        self.responses: queue.Queue = queue.Queue()
        self.call = stub.Draft(iter(self.requests.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for r in self.call:
                self.responses.put(r)
        except grpc.RpcError as exc:
            self.responses.put(exc)

    def send(self, sid: str, **kind) -> None:
        self.requests.put(drafter_pb2.DrafterRequest(session_id=sid, **kind))

    def open(self, sid: str, context: list[int], budget: int = 8, depth: int = 4, pipelined: bool = True,
             sampling: common_pb2.SamplingParams | None = None) -> None:
        self.send(sid, open=_open(context=context, budget=budget, depth=depth,
                                                    pipelined=pipelined, sampling=sampling))

    def commit(self, sid: str, step: int, accepted: list[int], bonus: int, budget: int = 8, depth: int = 4) -> None:
        self.send(sid, commit=drafter_pb2.CommitStep(step=step, accepted=accepted, bonus=bonus,
                                                     budget=budget, depth=depth))

    def recv(self, timeout: float = REPLY_TIMEOUT_S) -> drafter_pb2.DraftResponse:
        r = self.responses.get(timeout=timeout)
        if isinstance(r, Exception):
            raise r
        return r

    def ask(self, sid: str, **kind) -> drafter_pb2.DraftResponse:
        self.send(sid, **kind)
        r = self.recv()
        assert r.session_id == sid
        return r

    def close(self) -> None:
        self.requests.put(None)


def _service(request, tmp_path_factory, *args: str) -> Service:
    svc = Service(tmp_path_factory.mktemp("drafter"), *args)
    request.addfinalizer(svc.stop)
    return svc


@pytest.fixture(scope="module")
def ngram(request, tmp_path_factory) -> Service:
    return _service(request, tmp_path_factory, "--drafter", "ngram")


def _ngram_fresh(context: list[int], budget: int, depth: int, exclude=(), branches: int = 0) -> DraftTree:
    return NgramDrafter().open(list(context)).draft(budget, depth, GREEDY, make_generator(GREEDY), exclude, branches)


def _ngram_predraft(context: list[int], tree: DraftTree, budget: int, depth: int) -> tuple[list[int], DraftTree]:
    """In-process: the main path the service predrafts from, and its predraft tree."""
    h = [tree.tokens[i] for i in main_path(tree)]
    b, d, w = predraft_shape(budget, depth)
    return h, _ngram_fresh(context + h, b, d, (), w)


def _predrafted(context: list[int], tree: DraftTree, accepted: list[int], bonus: int) -> DraftTree | None:
    """In-process: the tree the service answers at once for this outcome of `tree` (budget 8,
    depth 4) when it predrafted that outcome (`specmesh.drafters.predraft`), else None."""
    path = main_path(tree)
    h = [tree.tokens[i] for i in path]
    k = len(accepted)
    if accepted != h[:k]:
        return None
    node = -1 if k == 0 else path[k - 1]
    below = () if k == len(h) else [tree.tokens[c] for c in children_of(tree)[node]]
    b, d, w = predraft_shape(8, 4)
    p = _ngram_fresh(context + accepted, b, d, below, w)
    return pick_predrafted(p, bonus, 8, 4, useful_depth(4, GREEDY))


def _context(seed: int, n: int = 60, vocab: int = 12) -> list[int]:
    """A repetitive context (the ngram drafter finds continuations in it)."""
    r = random.Random(seed)
    motifs = [[r.randrange(vocab) for _ in range(r.randint(3, 6))] for _ in range(3)]
    out: list[int] = []
    while len(out) < n:
        out += r.choice(motifs) if r.random() < 0.8 else [r.randrange(vocab)]
    return out


# --- health, reflection, basic protocol ---

def test_health_serving_and_reflection(ngram: Service) -> None:
    health = health_pb2_grpc.HealthStub(ngram.channel)
    for name in ("", "specmesh.v1.Drafter"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ngram.channel)
    replies = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert "specmesh.v1.Drafter" in names and "grpc.health.v1.Health" in names


def test_ngram_hit_miss_extend_give_the_right_trees(ngram: Service) -> None:
    s = ngram.stream()
    ctx = [1, 2, 3, 4, 5] * 4 + [1, 2]
    r = s.ask("a", open=_open(context=ctx, budget=8, depth=4, pipelined=True))
    assert (r.error, r.step, r.position, r.predrafted) == ("", 0, len(ctx), False)
    tree = tree_from_pb(r.tree)
    assert tree == _ngram_fresh(ctx, 8, 4) and len(tree) > 0

    # 1. a hit: the main path accepted whole, the bonus under one of the predraft's root children
    time.sleep(VERIFY_S)
    h, p = _ngram_predraft(ctx, tree, 8, 4)
    bonus = p.tokens[0]
    s.commit("a", 0, h, bonus)
    r = s.recv()
    ctx += h + [bonus]
    assert (r.error, r.step, r.position, r.predrafted) == ("", 1, len(ctx), True)
    assert tree_from_pb(r.tree) == pick_predrafted(p, bonus, 8, 4, useful_depth(4, GREEDY))

    # 2. a miss (a shorter accepted path, another shape): a fresh tree from the committed point
    time.sleep(VERIFY_S)
    h = [r.tree.tokens[i] for i in main_path(tree_from_pb(r.tree))]
    s.commit("a", 1, h[:1], 5, budget=6, depth=3)
    r = s.recv()
    ctx += h[:1] + [5]
    assert (r.error, r.step, r.position, r.predrafted) == ("", 2, len(ctx), False)
    assert tree_from_pb(r.tree) == _ngram_fresh(ctx, 6, 3)

    # 3. a follow-up turn: new tokens appended, a fresh tree for the next step
    time.sleep(VERIFY_S)
    r = s.ask("a", extend=drafter_pb2.ExtendSession(tokens=[9, 1, 2, 3], budget=8, depth=4))
    ctx += [9, 1, 2, 3]
    assert (r.error, r.step, r.position, r.predrafted) == ("", 3, len(ctx), False)
    assert tree_from_pb(r.tree) == _ngram_fresh(ctx, 8, 4)

    # 4. a turn that ended inside a verified path: keep a prefix, then append
    time.sleep(VERIFY_S)
    r = s.ask("a", extend=drafter_pb2.ExtendSession(tokens=[4, 5], budget=8, depth=4, keep=len(ctx) - 3))
    ctx = ctx[:-3] + [4, 5]
    assert (r.error, r.step, r.position, r.predrafted) == ("", 4, len(ctx), False)
    assert tree_from_pb(r.tree) == _ngram_fresh(ctx, 8, 4)
    s.send("a", close=drafter_pb2.CloseSession())

    # 5. keeping more than the session holds is refused, naming the field
    s.ask("b", open=_open(context=[1, 2, 3], budget=4, depth=2))
    r = s.ask("b", extend=drafter_pb2.ExtendSession(tokens=[4], budget=4, depth=2, keep=9))
    assert r.error.startswith("keep: must be in [1, 3]"), r.error
    s.commit("a", 3, [], 1)
    assert s.recv().error.startswith("session_id:")
    s.close()


def test_eight_sessions_interleaved_on_one_stream(ngram: Service) -> None:
    s = ngram.stream()
    contexts = {f"s{i}": _context(i) for i in range(8)}
    trees: dict[str, DraftTree] = {}
    for sid, ctx in contexts.items():
        s.open(sid, ctx, budget=8, depth=4)
    for _ in contexts:
        r = s.recv()
        assert r.error == "" and r.position == len(contexts[r.session_id])
        trees[r.session_id] = tree_from_pb(r.tree)
        assert trees[r.session_id] == _ngram_fresh(contexts[r.session_id], 8, 4)
    rng = random.Random(0)
    hits = 0
    for step in range(6):
        time.sleep(VERIFY_S)
        expected = {}
        for sid in rng.sample(sorted(contexts), len(contexts)):  # a new order every round
            ctx, tree = contexts[sid], trees[sid]
            h, p = _ngram_predraft(ctx, tree, 8, 4)
            if rng.random() < 0.5 and p.tokens:  # the outcome the service predrafted for
                accepted, bonus = h, p.tokens[0]
            else:
                accepted, bonus = h[: rng.randrange(len(h) + 1)], rng.randrange(12)
            s.commit(sid, step, accepted, bonus)
            ctx += accepted + [bonus]
            expected[sid] = (_predrafted(ctx[:-len(accepted) - 1], tree, accepted, bonus), _ngram_fresh(ctx, 8, 4))
        for _ in contexts:
            r = s.recv()
            sid = r.session_id
            assert (r.error, r.step, r.position) == ("", step + 1, len(contexts[sid]))
            trees[sid] = tree_from_pb(r.tree)
            hit, fresh = expected[sid]
            assert trees[sid] == (hit if r.predrafted else fresh), sid
            assert not r.predrafted or hit is not None
            hits += r.predrafted
    assert hits > 0
    s.close()


def test_bad_requests_get_an_error_naming_the_field(ngram: Service) -> None:
    s = ngram.stream()
    ctx = _context(1)
    assert s.ask("ok", open=_open(context=ctx, budget=8, depth=4)).error == ""
    sampling = common_pb2.SamplingParams
    bad = [
        ("x1", dict(commit=drafter_pb2.CommitStep(step=0, bonus=1, budget=8, depth=4)), "session_id:"),
        ("", dict(open=_open(context=ctx, budget=8, depth=4)), "session_id:"),
        ("x2", dict(open=_open(context=ctx, budget=0, depth=4)), "budget:"),
        ("x3", dict(open=_open(context=ctx, budget=65, depth=4)), "budget:"),
        ("x4", dict(open=_open(context=ctx, budget=8, depth=17)), "depth:"),
        ("x5", dict(open=_open(context=[], budget=8, depth=4)), "context:"),
        ("x6", dict(open=_open(context=[1, -3], budget=8, depth=4)), "context:"),
        ("x7", dict(open=_open(context=ctx, budget=8, depth=4,
                                                 sampling=sampling(temperature=-1))), "temperature:"),
        ("x8", dict(open=_open(context=ctx, budget=8, depth=4,
                                                 sampling=sampling(temperature=1, top_p=1.5))), "top_p:"),
        ("x9", {}, "kind:"),
        ("x10", dict(open=_open(context=ctx, budget=8, depth=4,
                                verify_cost=[drafter_pb2.CostPoint(rows=0, seconds=0.1)])), "verify_cost:"),
        ("x11", dict(open=_open(context=ctx, budget=8, depth=4,
                                verify_cost=[drafter_pb2.CostPoint(rows=2, seconds=-1.0)])), "verify_cost:"),
    ]
    for sid, kind, field in bad:
        r = s.ask(sid, **kind)
        assert r.error.startswith(field), (sid, r.error)
        assert not r.HasField("tree") or len(r.tree.tokens) == 0
    # errors inside a live session close it; the others keep working
    assert s.ask("v", open=_open(context=ctx, budget=8, depth=4)).error == ""
    for kind, field in [(dict(step=5, bonus=1, budget=8, depth=4), "step:"),
                        (dict(step=0, accepted=[-1], bonus=1, budget=8, depth=4), "accepted:"),
                        (dict(step=0, bonus=-2, budget=8, depth=4), "bonus:"),
                        (dict(step=0, bonus=1, budget=8, depth=0), "depth:")]:
        assert s.ask("v", commit=drafter_pb2.CommitStep(**kind)).error.startswith(field)
        assert s.ask("v", commit=drafter_pb2.CommitStep(step=0, bonus=1, budget=8, depth=4)).error.startswith(
            "session_id:"), "the session was closed by its error"
        assert s.ask("v", open=_open(context=ctx, budget=8, depth=4)).error == ""
    r = s.ask("ok", commit=drafter_pb2.CommitStep(step=0, accepted=[], bonus=ctx[0], budget=8, depth=4))
    assert (r.error, r.step, r.position) == ("", 1, len(ctx) + 1)
    assert tree_from_pb(r.tree) == _ngram_fresh(ctx + [ctx[0]], 8, 4)
    s.close()


def test_sessions_outlive_their_stream(ngram: Service) -> None:
    ctx = _context(7)
    first = ngram.stream()
    assert first.ask("moved", open=_open(context=ctx, budget=8, depth=4)).error == ""
    first.close()
    second = ngram.stream()
    r = second.ask("moved", commit=drafter_pb2.CommitStep(step=0, bonus=3, budget=4, depth=2))
    assert (r.error, r.step, r.position) == ("", 1, len(ctx) + 1)
    second.close()


# --- eviction ---

class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _ahead(context: list[int]) -> DraftAhead:
    return DraftAhead(NgramDrafter().open(context), len(context), GREEDY, pipelined=True)


def test_session_store_lru_idle_and_replace() -> None:
    clock = _Clock()
    store = SessionStore(max_sessions=2, idle_timeout_s=10, clock=clock)
    a, b, c = (_ahead([1, 2, 3]) for _ in range(3))
    store.put("a", a)
    store.put("b", b)
    assert store.get("a") is a  # "a" is now the most recently used
    store.put("c", c)
    assert store.get("b") is None and b.closed and not a.closed and len(store) == 2
    clock.now = 8.0
    assert store.get("c", touch=False) is c  # predrafting does not keep a session alive
    assert store.get("a") is a
    clock.now = 10.5  # "c" idle for 10.5 s: evicted; "a" for 2.5 s
    assert store.get("c") is None and c.closed and store.get("a") is a
    clock.now = 10.5 + 10.1
    assert store.sweep() == 1 and a.closed and len(store) == 0
    assert store.evicted == 3
    d, e = _ahead([1, 2]), _ahead([1, 2])
    store.put("d", d)
    store.put("d", e)  # opening an existing id replaces (and closes) the old session
    assert d.closed and store.get("d") is e
    store.pop("d")
    assert e.closed and len(store) == 0


def test_session_store_counts_the_sessions_served_at_once() -> None:
    clock = _Clock()
    store = SessionStore(max_sessions=8, idle_timeout_s=60, clock=clock)
    assert store.busy() == 1  # none: a session asking counts itself
    for sid in "abc":
        store.put(sid, _ahead([1, 2, 3]))
    assert store.busy() == 3
    clock.now = BUSY_S + 0.1
    store.get("a")  # only "a" asked since
    assert store.busy() == 1
    store.get("b", touch=False)  # predrafting is not a request
    assert store.busy() == 1
    store.close_all()


def test_session_store_bounds_the_tokens_held() -> None:
    store = SessionStore(max_sessions=10, idle_timeout_s=10, max_total_tokens=10)
    a, b, c = _ahead([1] * 4), _ahead([2] * 4), _ahead([3] * 5)
    store.put("a", a)
    store.put("b", b)
    assert store.get("a") is a  # "b" is now the least recently used
    store.put("c", c)  # 13 tokens > 10: "b" goes, 9 are left
    assert b.closed and store.get("b") is None and not a.closed and store.get("c") is c
    big = _ahead([4] * 12)  # more than the bound alone: kept (the newest is never evicted), the rest go
    store.put("big", big)
    assert a.closed and c.closed and store.get("big") is big and len(store) == 1


@pytest.fixture(scope="module")
def small(request, tmp_path_factory) -> Service:
    return _service(request, tmp_path_factory, "--drafter", "ngram", "--max-sessions", "2", "--idle-timeout-s", "3",
                    "--max-context-tokens", "100", "--max-total-tokens", "150")


def test_lru_eviction_and_idle_timeout(small: Service) -> None:
    s = small.stream()
    ctx = _context(3)
    for sid in ("a", "b"):
        assert s.ask(sid, open=_open(context=ctx, budget=4, depth=2)).error == ""
    # "a" used last, so opening "c" evicts "b"
    assert s.ask("a", commit=drafter_pb2.CommitStep(step=0, bonus=1, budget=4, depth=2)).error == ""
    assert s.ask("c", open=_open(context=ctx, budget=4, depth=2)).error == ""
    assert s.ask("b", commit=drafter_pb2.CommitStep(step=0, bonus=1, budget=4, depth=2)).error.startswith("session_id:")
    assert s.ask("a", commit=drafter_pb2.CommitStep(step=1, bonus=1, budget=4, depth=2)).error == ""
    assert s.ask("c", commit=drafter_pb2.CommitStep(step=0, bonus=1, budget=4, depth=2)).error == ""
    time.sleep(3.5)  # idle past the 3 s timeout: evicted
    assert s.ask("a", commit=drafter_pb2.CommitStep(step=2, bonus=1, budget=4, depth=2)).error.startswith("session_id:")
    s.close()


def test_context_and_memory_caps(small: Service) -> None:
    """--max-context-tokens 100: a request that would make one session hold more is refused, naming
    the field, and the stream goes on; --max-total-tokens 150: opening past it evicts the least
    recently used session."""
    s = small.stream()
    r = s.ask("huge", open=_open(context=list(range(1, 102)), budget=4, depth=2))
    assert r.error.startswith("context:") and "max-context-tokens" in r.error, r.error
    assert s.ask("t1", open=_open(context=list(range(1, 71)), budget=4, depth=2)).error == ""
    assert s.ask("t2", open=_open(context=list(range(1, 86)), budget=4, depth=2)).error == ""  # 155 > 150
    assert s.ask("t1", commit=drafter_pb2.CommitStep(step=0, bonus=1, budget=4, depth=2)).error.startswith("session_id:")
    r = s.ask("t2", commit=drafter_pb2.CommitStep(step=0, accepted=list(range(1, 16)), bonus=1, budget=4, depth=2))
    assert r.error.startswith("accepted:"), r.error  # 85 + 16 > 100
    assert s.ask("t3", open=_open(context=list(range(1, 11)), budget=4, depth=2)).error == ""  # still serving
    s.close()


# --- oracle ---

VOCAB = 1000


def _reference(seed: int, length: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(VOCAB) for _ in range(length)]


@pytest.fixture(scope="module")
def oracle(request, tmp_path_factory) -> tuple[Service, list[list[int]]]:
    refs = [_reference(i, 400) for i in range(3)]
    path = tmp_path_factory.mktemp("oracle") / "reference.json"
    path.write_text(json.dumps(refs))
    svc = _service(request, tmp_path_factory, "--drafter", "oracle:1.0", "--oracle-reference", str(path),
                   "--vocab-size", str(VOCAB), "--draft-cost-s", "0.002")
    return svc, refs


def _verify_against(reference: list[int], position: int, tree: DraftTree) -> tuple[list[int], int]:
    """A verifier whose target continues with `reference`: accepted = the longest prefix of the
    main path that matches it, bonus = the next reference token."""
    accepted = []
    for i in main_path(tree):
        if tree.tokens[i] != reference[position + len(accepted)]:
            break
        accepted.append(tree.tokens[i])
    return accepted, reference[position + len(accepted)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_oracle_predraft_hit_rate(oracle, temperature: float) -> None:
    svc, refs = oracle
    s = svc.stream()
    sessions = {f"o{i}": (ref, 20 + 10 * i) for i, ref in enumerate(refs)}  # prompts of different lengths
    sampling = common_pb2.SamplingParams(temperature=temperature, seed=5)
    for sid, (ref, prompt) in sessions.items():
        s.open(sid, ref[:prompt], budget=8, depth=4, sampling=sampling)
    replies = {r.session_id: r for r in (s.recv() for _ in sessions)}
    hits = steps = 0
    for step in range(20):
        time.sleep(VERIFY_S)
        for sid, (ref, _) in sessions.items():
            r = replies[sid]
            assert r.error == "" and r.step == step
            tree = tree_from_pb(r.tree)
            validate_tree(tree, VOCAB, 64, 16, need_q=temperature > 0)
            accepted, bonus = _verify_against(ref, r.position, tree)
            assert len(accepted) == len(main_path(tree)) == 4, "alpha = 1: the main path is the reference"
            s.commit(sid, step, accepted, bonus)
        for _ in sessions:
            r = s.recv()
            prev = replies[r.session_id]
            assert r.position == prev.position + 5
            replies[r.session_id] = r
            hits += r.predrafted
            steps += 1
    assert hits / steps > 0.5, f"predraft hit rate {hits}/{steps}"
    s.close()


def test_pushed_predrafts_let_the_verifier_take_the_next_tree(oracle) -> None:
    """push_predrafts: predrafts come as they are made; a commit that took the next tree from one
    gets no answer, and the session goes on from that very tree (its next predrafts are rooted
    after it); a took_predraft the drafter cannot match is an error for that session only."""
    svc, refs = oracle
    ref, prompt = refs[1], 30
    s = svc.stream()
    s.send("p", open=_open(context=ref[:prompt], budget=4, depth=4, pipelined=True,
                                              push_predrafts=True))
    first = s.recv()
    assert first.error == "" and not first.HasField("ahead") and first.step == 0
    tree, position, taken = tree_from_pb(first.tree), first.position, 0
    for step in range(6):
        accepted, bonus = _verify_against(ref, position, tree)
        pushed = {}
        while tuple(accepted) not in pushed:  # the predrafts of this step, as they come
            r = s.recv()
            assert r.session_id == "p" and r.error == "" and r.HasField("ahead") and r.step <= step
            if r.step < step:
                continue  # the rest of the last step's predrafts
            assert r.position == position + len(r.ahead.accepted)
            pushed[tuple(r.ahead.accepted)] = tree_from_pb(r.tree)
        nxt = pick_predrafted(pushed[tuple(accepted)], bonus, 4, 4, useful_depth(4, GREEDY))
        assert nxt is not None, "alpha 1: the predraft's first bonus candidate is the reference's"
        s.send("p", commit=drafter_pb2.CommitStep(step=step, accepted=accepted, bonus=bonus, budget=4, depth=4,
                                                  took_predraft=True))
        tree, position = nxt, position + len(accepted) + 1
        assert [tree.tokens[i] for i in main_path(tree)] == ref[position:position + 4]
        taken += 1
    # the drafter went on from the trees taken: its next predrafts are for step 6, after them
    r = s.recv()
    while r.step < 6:
        r = s.recv()
    assert r.HasField("ahead") and r.step == 6 and r.position == position + len(r.ahead.accepted)
    # a took_predraft for an outcome no predraft has (a bonus off the reference): an error for
    # that session; another session on the stream goes on
    s.open("q", ref[:prompt], budget=4, depth=4, pipelined=False)
    s.send("p", commit=drafter_pb2.CommitStep(step=6, accepted=[], bonus=(ref[position] + 1) % VOCAB,
                                              budget=4, depth=4, took_predraft=True))
    replies = {}
    while "q" not in replies or "p" not in replies:
        r = s.recv()
        if not r.HasField("ahead"):
            replies[r.session_id] = r
    assert replies["p"].error.startswith("took_predraft:") and replies["q"].error == ""
    r = s.ask("q", commit=drafter_pb2.CommitStep(step=0, accepted=[], bonus=ref[prompt], budget=4, depth=4))
    assert r.error == "" and r.step == 1 and r.position == prompt + 1
    assert taken == 6
    s.close()


def test_a_drafter_on_the_verifiers_cores_predrafts_nothing(oracle) -> None:
    """OpenSession.shares_cores (the verifier takes the cores this drafter runs on): a pipelined
    session whose predrafts would hit every time (the oracle at alpha 1, as in the test above)
    gets every tree drafted at its commit, none beside the verification."""
    svc, refs = oracle
    ref, prompt = refs[1], 30
    s = svc.stream()
    first = s.ask("c", open=_open(context=ref[:prompt], budget=4, depth=4, pipelined=True, push_predrafts=True,
                                  shares_cores=True))
    assert first.error == "" and first.step == 0
    tree, position = tree_from_pb(first.tree), first.position
    for step in range(6):
        time.sleep(VERIFY_S)
        accepted, bonus = _verify_against(ref, position, tree)
        r = s.ask("c", commit=drafter_pb2.CommitStep(step=step, accepted=accepted, bonus=bonus, budget=4, depth=4))
        assert r.error == "" and not r.HasField("ahead") and not r.predrafted and r.step == step + 1
        tree, position = tree_from_pb(r.tree), r.position
    s.close()


def test_oracle_checks_the_vocabulary(oracle) -> None:
    svc, refs = oracle
    s = svc.stream()
    r = s.ask("v", open=_open(context=[1, VOCAB], budget=8, depth=4))
    assert r.error.startswith("context:") and str(VOCAB) in r.error
    assert s.ask("v", open=_open(context=refs[0][:10], budget=8, depth=4)).error == ""
    r = s.ask("v", commit=drafter_pb2.CommitStep(step=0, accepted=[VOCAB + 1], bonus=0, budget=8, depth=4))
    assert r.error.startswith("accepted:")
    s.close()


# --- model ---

@pytest.fixture(scope="module")
def model(request, tmp_path_factory) -> tuple[Service, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    # fp32 as the test's own copy: under --dtype auto a drafter may take a faster format that
    # changes its numerics (q8 on some hosts), and a random model's near-tied siblings with them
    return _service(request, tmp_path_factory, "--drafter", f"model:{path}", "--dtype", "float32"), path


def test_model_drafter_greedy_and_sampling(model) -> None:
    from specmesh.drafters.model import ModelDrafter
    from specmesh.loader import load_model

    svc, path = model
    drafter = ModelDrafter(load_model(path))

    def fresh(context: list[int], budget: int, depth: int) -> DraftTree:
        return drafter.open(list(context)).draft(budget, depth, GREEDY, make_generator(GREEDY))

    s = svc.stream()
    ctx = [random.Random(0).randrange(256) for _ in range(20)]
    fresh(ctx, 8, 4)  # warm: a first in-process call here would look like a slow verification
    r = s.ask("m", open=_open(context=ctx, budget=8, depth=4, pipelined=True))
    hits, served = 0, []
    for step in range(6):
        assert (r.error, r.step, r.position) == ("", step, len(ctx))
        t0 = time.perf_counter()  # the test is the verifier: what it does until the commit is its step
        tree = tree_from_pb(r.tree)
        time.sleep(MODEL_VERIFY_S)
        h = [tree.tokens[i] for i in main_path(tree)]
        if step < 5:  # the likeliest outcome, predrafted for: main path + the drafter's own next token
            accepted, bonus = h, fresh(ctx + h, 1, 1).tokens[0]
        else:  # a miss
            accepted, bonus = h[:1], 7
        r_next = s.ask("m", commit=drafter_pb2.CommitStep(step=step, accepted=accepted, bonus=bonus, budget=8,
                                                          depth=4, verify_s=time.perf_counter() - t0))
        # checked after the session: drafting here, between a commit and the next step, would add
        # unreported time to every step period the planner measures, and it would stop predrafting
        served.append((list(ctx), tree, r.predrafted))
        r = r_next
        ctx += accepted + [bonus]
        hits += r.predrafted
    assert hits >= 3, "the predraft (5 forwards of a tiny model) should be ready in time"
    for context, tree, predrafted in served:
        want = fresh(context, 8, 4)
        assert tree == want or (predrafted and tree.tokens[0] == want.tokens[0])
    # sampling: every tree, predrafted or not, carries an exact q for each expanded node
    sampling = common_pb2.SamplingParams(temperature=0.8, top_k=50, seed=1)
    r = s.ask("t", open=_open(context=ctx, budget=8, depth=4, sampling=sampling, pipelined=True))
    for step in range(6):
        assert r.error == ""
        tree = tree_from_pb(r.tree)
        validate_tree(tree, 256, 8, 4, need_q=True)
        time.sleep(MODEL_VERIFY_S)
        h = [tree.tokens[i] for i in main_path(tree)]
        r = s.ask("t", commit=drafter_pb2.CommitStep(step=step, accepted=h, bonus=tree.tokens[0], budget=8, depth=4,
                                                     verify_s=MODEL_VERIFY_S))
    assert s.ask("t", commit=drafter_pb2.CommitStep(step=6, bonus=256, budget=8, depth=4)).error.startswith("bonus:")
    s.close()


# --- feature drafter ---

@pytest.fixture(scope="module")
def feature(request, tmp_path_factory) -> Service:
    """The feature drafter shipped for the bundled target (EAGLE-style: needs the target's states)."""
    from specmesh.drafters import bundled_drafter_path

    return _service(request, tmp_path_factory, "--drafter", f"model:{bundled_drafter_path()}")


def _feats(rows: int, dim: int = 576) -> bytes:
    from specmesh.convert import features_to_pb

    return features_to_pb(torch.randn(rows, dim, generator=torch.Generator().manual_seed(rows)))


def test_feature_drafter_announces_its_width_and_checks_features(feature: Service, ngram: Service) -> None:
    s = feature.stream()
    assert dict(s.call.initial_metadata())["specmesh-feature-dim"] == "576"
    t = ngram.stream()
    assert dict(t.call.initial_metadata())["specmesh-feature-dim"] == "0"
    t.close()
    ctx = [1, 504, 3003, 4683, 359, 42]
    # no features, or the wrong number of rows: an error naming the field, the session closed
    assert s.ask("f0", open=_open(context=ctx, budget=4, depth=4)).error.startswith("features:")
    r = s.ask("f1", open=_open(context=ctx, budget=4, depth=4, features=_feats(len(ctx))))
    assert r.error.startswith("features: expected 5 x 576")
    # right: a tree; then a commit and an extend, each with its rows
    good = s.ask("f2", open=_open(context=ctx, budget=4, depth=4, features=_feats(len(ctx) - 1)))
    assert good.error == "" and len(good.tree.tokens) == 4
    r = s.ask("f2", commit=drafter_pb2.CommitStep(step=0, accepted=[], bonus=28, budget=4, depth=4, features=_feats(1)))
    assert r.error == "" and r.step == 1
    r = s.ask("f2", extend=drafter_pb2.ExtendSession(tokens=[10062, 28], budget=4, depth=4, features=_feats(2)))
    assert r.error == "" and r.step == 2 and r.position == len(ctx) + 3
    # a bad commit closes that session only
    r = s.ask("f3", open=_open(context=ctx, budget=4, depth=4, features=_feats(len(ctx) - 1)))
    assert s.ask("f3", commit=drafter_pb2.CommitStep(step=0, accepted=[], bonus=28, budget=4, depth=4,
                                                     features=_feats(2))).error.startswith("features:")
    r = s.ask("f2", commit=drafter_pb2.CommitStep(step=2, accepted=[], bonus=30, budget=4, depth=4, features=_feats(1)))
    assert r.error == "" and r.step == 3
    s.close()


# --- grammars ---

@pytest.fixture(scope="module")
def ngram_tok(request, tmp_path_factory) -> Service:
    """An n-gram drafter given the bundled target's tokenizer: it follows grammars."""
    from specmesh.loader import bundled_target_path

    return _service(request, tmp_path_factory, "--drafter", "ngram", "--tokenizer", str(bundled_target_path()))


def test_a_drafter_with_a_tokenizer_prunes_its_trees_to_the_turns_grammar(ngram_tok: Service, ngram: Service) -> None:
    from specmesh.convert import structured_to_pb
    from specmesh.drafters.base import turn_guide
    from specmesh.grammar import Grammars, GrammarSpec
    from specmesh.loader import bundled_target_path, load_tokenizer

    tok = load_tokenizer(bundled_target_path())
    grammars = Grammars(tok, len(tok))
    spec = GrammarSpec("regex", r' \{"[a-z]": [0-9]\}')
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    # "Answer:" was followed by JSON twice and by prose once: the n-gram drafter offers both
    ctx = enc('Answer: {"a": 1}\nAnswer: no idea\nAnswer: {"b": 2}\nAnswer:')

    def local(context: list[int], output: int | None) -> DraftTree:
        start = len(context) - (output or 0)
        guide = turn_guide(GREEDY, start, None if output is None else grammars.guide(spec))
        return NgramDrafter().open(list(context)).draft(8, 4, GREEDY, make_generator(GREEDY), guide=guide)

    def allowed_only(tree: DraftTree, output: list[int]) -> None:
        for node, token in enumerate(tree.tokens):
            path, at = [token], tree.parents[node]
            while at != -1:
                path.insert(0, tree.tokens[at])
                at = tree.parents[at]
            fresh = grammars.constraint(spec)
            fresh.add(output + path[:-1])
            assert fresh.allowed()[token], tok.decode(output + path)

    s = ngram_tok.stream()
    assert dict(s.call.initial_metadata())["specmesh-grammar"] == "llguidance"
    r = s.ask("g", open=_open(context=ctx, budget=8, depth=4, pipelined=False, structured=structured_to_pb(spec)))
    tree = tree_from_pb(r.tree)
    assert r.error == "" and tree == local(ctx, 0)
    assert enc(" no")[0] not in tree.tokens and len(local(ctx, None)) > len(tree), "the prose branch is pruned"
    allowed_only(tree, [])
    # the turn goes on: a commit, then a plain run's tokens (same_turn): still the grammar's state
    out = enc(' {"b')
    r = s.ask("g", commit=drafter_pb2.CommitStep(step=0, accepted=out[:1], bonus=out[1], budget=8, depth=4))
    assert r.error == "" and tree_from_pb(r.tree) == local(ctx + out, len(out))
    allowed_only(tree_from_pb(r.tree), out)
    run = enc('":')
    r = s.ask("g", extend=drafter_pb2.ExtendSession(tokens=run, budget=8, depth=4, same_turn=True))
    out += run
    assert r.error == "" and tree_from_pb(r.tree) == local(ctx + out, len(out))
    allowed_only(tree_from_pb(r.tree), out)
    # a new turn without a grammar: trees are the drafter's own again
    turn = enc(' 2}\nAnswer:')
    r = s.ask("g", extend=drafter_pb2.ExtendSession(tokens=turn, budget=8, depth=4))
    assert r.error == "" and tree_from_pb(r.tree) == local(ctx + out + turn, None)
    s.close()
    # a drafter without a tokenizer announces none, and refuses a grammar naming the field
    t = ngram.stream()
    assert "specmesh-grammar" not in dict(t.call.initial_metadata())
    r = t.ask("h", open=_open(context=ctx, budget=8, depth=4, structured=structured_to_pb(spec)))
    assert r.error.startswith("structured:")
    t.close()


# --- shutdown ---

def test_sigterm_exits_promptly(tmp_path: Path) -> None:
    svc = Service(tmp_path, "--drafter", "ngram", "--grace-s", "1")
    try:
        s = svc.stream()
        assert s.ask("a", open=_open(context=_context(2), budget=8, depth=4)).error == ""
        t = time.monotonic()
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(10) == 0
        assert time.monotonic() - t < 5
        s.close()
    finally:
        svc.stop()
