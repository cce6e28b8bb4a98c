"""Drafter and verifier services as real processes on 127.0.0.1, with the bundled SmolLM2:
greedy output through gRPC identical to the in-process engine (TP=1 and TP=2 over gloo), with
every drafter, a killed drafter, a malicious drafter; KV reuse across turns; concurrency; bad
requests; graceful shutdown; structured output through a drafter that follows the grammar and
resumed after a failover."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
import torch

from loadtest.scrape import parse_prometheus
from specmesh.engine import StopConditions, generate
from specmesh.runtime import encode_prompt, load_target
from specmesh.sampling import SamplingParams
from specmesh.redis_server import free_port
from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.e2e.procs import start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Repeat exactly: one two three, one two three, one two three.",
    "Name three primary colors.",
]
N = 20


@pytest.fixture(scope="module")
def local():
    torch.set_num_threads(1)
    model, tok = load_target(None)
    eos = frozenset([tok.eos_token_id])
    cases = []
    for text in PROMPTS:
        ids = encode_prompt(tok, text, chat=True)
        cases.append((ids, generate(model, ids, SamplingParams(), StopConditions(N, eos)).token_ids))
    return model, tok, cases


@pytest.fixture(scope="module")
def reference_file(local, tmp_path_factory):
    _m, _t, cases = local
    path = tmp_path_factory.mktemp("oracle") / "reference.json"
    path.write_text(json.dumps([ids + out for ids, out in cases]))
    return str(path)


@pytest.fixture(scope="module")
def ngram():
    port = free_port()  # its Prometheus metrics: sessions opened
    p = start("drafter_service", "--drafter", "ngram", "--threads", "1", "--metrics-port", str(port))
    p.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield p
    p.stop()


def opened(drafter) -> float:
    with urllib.request.urlopen(drafter.metrics_url, timeout=10) as r:
        return parse_prometheus(r.read().decode())["specmesh_drafter_sessions_opened_total"]


@pytest.fixture(scope="module")
def feature():
    """The drafter shipped for the bundled target: a feature drafter (EAGLE-style), so the verifier
    sends the target's features with every open, extend and commit. Given the target's tokenizer,
    it follows a turn's grammar."""
    from specmesh.drafters import bundled_drafter_path
    from specmesh.loader import bundled_target_path

    port = free_port()
    p = start("drafter_service", "--drafter", f"model:{bundled_drafter_path()}", "--threads", "1",
              "--metrics-port", str(port), "--tokenizer", str(bundled_target_path()))
    p.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield p
    p.stop()


@pytest.fixture(scope="module")
def oracle(reference_file):
    p = start("drafter_service", "--drafter", "oracle:0.8", "--oracle-reference", reference_file, "--threads", "1")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def verifier():
    # batched verification on (auto would leave it off at one thread): every TP=1 test below runs
    # through it, the 8 concurrent sessions included
    # float32, as `local` decodes (and as TP=2 serves): the default (auto) serves the bundled GGUF as
    # it ships, which tests/test_up.py and the router tests run
    p = start("verifier_service", "--threads", "1", "--draft-deadline-s", "5", "--batching", "on",
              "--drafter-allow", "127.0.0.1:*", "--dtype", "float32")  # requests name their drafter: any local port
    yield p
    p.stop()


@pytest.fixture(scope="module")
def verifier_tp2():
    p = start("verifier_service", "--tp", "2", "--threads", "1", "--draft-deadline-s", "5",
              "--drafter-allow", "127.0.0.1:*")
    yield p
    p.stop()


def stub(addr: str) -> verifier_pb2_grpc.VerifierStub:
    return verifier_pb2_grpc.VerifierStub(grpc.insecure_channel(addr))


def run(addr: str, ids: list[int] | None = None, *, drafter: str = "", timeout: float = 300, **kw):
    req = verifier_pb2.GenerateRequest(max_tokens=kw.pop("max_tokens", N), drafter_address=drafter, **kw)
    if ids is not None:
        req.token_ids.ids.extend(ids)
    out, complete = [], None
    for r in stub(addr).Generate(req, timeout=timeout):
        if r.HasField("chunk"):
            out.extend(r.chunk.token_ids)
        else:
            complete = r.complete
    return out, complete


@pytest.mark.parametrize("which", ["none", "ngram", "oracle", "feature"])
@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_identical_to_in_process(local, request, which, tp):
    _m, _t, cases = local
    addr = request.getfixturevalue("verifier" if tp == 1 else "verifier_tp2").address
    drafter = "" if which == "none" else request.getfixturevalue(which).address
    accepted = 0
    for ids, expected in cases[: 4 if tp == 1 else 2]:
        out, complete = run(addr, ids, drafter=drafter)
        assert out == expected
        assert complete.usage.completion_tokens == len(expected)
        assert complete.speculation.drafter_timeouts == 0 or which == "none"
        accepted += complete.speculation.accepted_tokens
    if which in ("oracle", "feature"):
        assert accepted > 0


def test_a_drafter_plans_each_verifiers_sessions_from_that_verifiers_costs(local, verifier, verifier_tp2, ngram):
    """Two verifiers (one rank, two ranks) share a drafter: each names itself when it opens a
    session, and the drafter keeps each one's measured verification apart (exported per verifier),
    rather than refitting one set of costs to whichever opened a session last."""
    ids = local[2][0][0]
    for addr in (verifier.address, verifier_tp2.address):
        run(addr, ids, drafter=ngram.address, max_tokens=8)
    with urllib.request.urlopen(ngram.metrics_url, timeout=10) as r:
        scraped = parse_prometheus(r.read().decode())
    one_row = {k.split('verifier="')[1].split('"')[0]: v for k, v in scraped.items()
               if k.startswith("specmesh_drafter_verify_cost_seconds{") and 'when="alone",rows="1"' in k}
    assert len(one_row) >= 2 and "" not in one_row  # each verifier named itself, none shares another's costs
    assert len(set(one_row.values())) == len(one_row)  # each its own steps (2 ranks measure apart from 1)


def test_seeded_sampling_reproducible(local, verifier, ngram):
    ids = local[2][1][0]
    sampling = common_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    a, _ = run(verifier.address, ids, drafter=ngram.address, sampling=sampling, ignore_eos=True)
    b, _ = run(verifier.address, ids, drafter=ngram.address, sampling=sampling, ignore_eos=True)
    c, _ = run(verifier.address, ids, sampling=sampling, ignore_eos=True)  # no drafter: same sample space
    assert a == b and len(a) == N
    assert all(0 <= t < 49152 for t in c)


@pytest.mark.parametrize("which", ["ngram", "feature"])
def test_second_turn_reuses_kv_cache(local, verifier, request, which):
    """...the verifier's and the drafter's: turn 2 extends the drafter session of turn 1 (with the
    target's features of the new tokens, for the feature drafter)."""
    model, tok, cases = local
    drafter = request.getfixturevalue(which)
    ids, first = cases[0]
    before = opened(drafter)
    sid = f"kv-{which}"
    out1, c1 = run(verifier.address, ids, drafter=drafter.address, session_id=sid)
    assert out1 == first and c1.usage.cached_prompt_tokens == 0
    follow = encode_prompt(tok, "And of Italy?", chat=True)
    out2, c2 = run(verifier.address, follow, drafter=drafter.address, session_id=sid)
    assert opened(drafter) == before + 1  # one drafter session for both turns (ExtendSession)
    assert c2.speculation.drafter_timeouts == 0  # every tree of turn 2 came from the extended session
    assert c2.usage.cached_prompt_tokens == len(ids) + len(out1)
    assert c2.usage.prompt_tokens == len(ids) + len(out1) + len(follow)
    expected = generate(model, ids + out1 + follow, SamplingParams(),
                        StopConditions(N, frozenset([tok.eos_token_id]))).token_ids
    assert out2 == expected


def test_drafter_that_evicted_the_session_reopens_it(local, verifier):
    """A drafter holding one session (--max-sessions 1) drops kv-a while kv-b drafts: kv-a's next
    turn finds its drafter session gone, opens it afresh once, and still speculates."""
    model, tok, cases = local
    port = free_port()
    d = start("drafter_service", "--drafter", "ngram", "--threads", "1", "--max-sessions", "1",
              "--metrics-port", str(port))
    d.metrics_url = f"http://127.0.0.1:{port}/metrics"
    try:
        (ids_a, first_a), (ids_b, _) = cases[0], cases[1]
        assert run(verifier.address, ids_a, drafter=d.address, session_id="evict-a")[0] == first_a
        run(verifier.address, ids_b, drafter=d.address, session_id="evict-b")  # evicts evict-a there
        follow = encode_prompt(tok, "Say it again.", chat=True)
        out, c = run(verifier.address, follow, drafter=d.address, session_id="evict-a")
        assert opened(d) == 3  # a, b, a again
        assert c.speculation.drafter_timeouts == 0  # the reopened session answered every step
        expected = generate(model, ids_a + first_a + follow, SamplingParams(),
                            StopConditions(N, frozenset([tok.eos_token_id]))).token_ids
        assert out == expected
    finally:
        d.stop()


def test_eight_concurrent_sessions(local, verifier, oracle):
    cases = local[2]
    jobs = [(f"conc-{i}", *cases[i % len(cases)]) for i in range(8)]
    with futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda j: run(verifier.address, j[1], drafter=oracle.address, session_id=j[0])[0], jobs))
    assert outs == [j[2] for j in jobs]


def test_drafter_killed_mid_generation(local, reference_file, verifier):
    ids, expected = local[2][0]
    slow = start("drafter_service", "--drafter", "oracle:0.8", "--oracle-reference", reference_file,
                 "--draft-cost-s", "0.3", "--threads", "1")
    got: list[int] = []
    first = threading.Event()
    box: dict = {}

    def consume():
        req = verifier_pb2.GenerateRequest(max_tokens=N, drafter_address=slow.address)
        req.token_ids.ids.extend(ids)
        for r in stub(verifier.address).Generate(req, timeout=300):
            if r.HasField("chunk"):
                got.extend(r.chunk.token_ids)
                first.set()
            else:
                box["complete"] = r.complete

    t = threading.Thread(target=consume)
    t.start()
    assert first.wait(120)
    slow.kill9()
    t.join(180)
    assert not t.is_alive() and got == expected and "complete" in box


@pytest.mark.parametrize("field, req", [
    ("max_tokens", dict(max_tokens=0)),
    ("temperature", dict(sampling=common_pb2.SamplingParams(temperature=-1))),
    ("top_p", dict(sampling=common_pb2.SamplingParams(temperature=1, top_p=1.5))),
    ("top_p", dict(sampling=common_pb2.SamplingParams(temperature=1, top_p=0.0))),  # explicit 0: not "unset"
    ("repetition_penalty", dict(sampling=common_pb2.SamplingParams(repetition_penalty=0.0))),
    ("token_ids", dict(token_ids=verifier_pb2.TokenIds(ids=[1, 10**8]))),
    ("stop_token_ids", dict(stop_token_ids=[-4])),
    ("speculation.budget", dict(speculation=verifier_pb2.SpeculationOptions(budget=1000))),
    ("speculation.depth", dict(speculation=verifier_pb2.SpeculationOptions(depth=99))),
    ("input", dict(max_tokens=4, session_id="never-seen")),
    ("drafter_address", dict(drafter_address="10.0.0.1:1")),  # not allowed: never dialled
])
def test_bad_request_is_invalid_argument(local, verifier, field, req):
    base = dict(max_tokens=4, token_ids=verifier_pb2.TokenIds(ids=local[2][0][0]))
    base.update(req)
    if field == "input":
        base.pop("token_ids")
    with pytest.raises(grpc.RpcError) as e:
        list(stub(verifier.address).Generate(verifier_pb2.GenerateRequest(**base), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    # nothing lost: the service and an existing session go on
    out, _ = run(verifier.address, local[2][0][0], max_tokens=3)
    assert out == local[2][0][1][:3]


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def test_structured_turn_through_a_guided_drafter_and_resumed_after_a_failover(local, verifier, feature):
    """The drafter that follows the grammar gives the constrained output with a higher acceptance
    than the same drafter unguided (fixed trees, no pipelining: both runs deterministic); a turn
    resumed mid-output on a verifier (the router's failover request) goes on in the grammar's state."""
    from specmesh.convert import structured_to_pb
    from specmesh.drafters import bundled_drafter_path
    from specmesh.grammar import Grammars, GrammarSpec

    model, tok, _ = local
    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    ids = encode_prompt(tok, "Describe Ann, 31, from Oslo, as JSON.", chat=True)
    stop = StopConditions(40, frozenset([tok.eos_token_id]))
    ref = generate(model, ids, SamplingParams(), stop,
                   constraint=Grammars(tok, model.config.vocab_size).constraint(spec)).token_ids
    opts = verifier_pb2.SpeculationOptions(budget=8, depth=4, fixed=True, no_pipelining=True)
    unguided = start("drafter_service", "--drafter", f"model:{bundled_drafter_path()}", "--threads", "1")
    try:
        rates = {}
        for name, drafter in (("guided", feature), ("unguided", unguided)):
            out, done = run(verifier.address, ids, drafter=drafter.address, max_tokens=40,
                            structured=structured_to_pb(spec), speculation=opts)
            assert out == ref, name
            rates[name] = done.speculation.acceptance_rate
        assert rates["guided"] > rates["unguided"], rates
    finally:
        unguided.stop()
    k = len(ref) // 2
    out, _ = run(verifier.address, None, drafter=feature.address, max_tokens=40 - k, structured=structured_to_pb(spec),
                 history=verifier_pb2.TokenIds(ids=ids + ref[:k]), token_ids=verifier_pb2.TokenIds(),
                 resumed_output_tokens=k)
    assert out == ref[k:]


class BadDrafter(drafter_pb2_grpc.DrafterServicer):
    """A malicious drafter speaking the protocol: garbage trees, wrong steps, slow answers; with
    `reference` (the prompt and the target's continuation) it also pushes predrafts the verifier
    will take (the right bonus token at the root, garbage below it) and malformed ones."""

    def __init__(self, mode: str, reference: list[int] | None = None) -> None:
        self.mode = mode
        self.reference = reference

    def Draft(self, request_iterator, context):
        import random

        r = random.Random(0)
        position: dict[str, int] = {}
        for req in request_iterator:
            kind = req.WhichOneof("kind")
            if kind == "close":
                continue
            step = 0 if kind == "open" else req.commit.step + 1
            if kind == "open":
                position[req.session_id] = len(req.open.context)
            elif kind == "commit":
                position[req.session_id] += len(req.commit.accepted) + 1
            if self.mode == "push":
                # for the outcome "nothing accepted" of this step's (garbage) tree: at odd steps the
                # right bonus token, then a wrong chain; at even steps a malformed predraft
                at = position[req.session_id]
                tokens = [self.reference[at]] + [(t + 1) % 49152 for t in self.reference[at + 1:at + 6]]
                parents = list(range(-1, len(tokens) - 1)) if step % 2 else [1, 0] + list(range(1, len(tokens) - 1))
                yield drafter_pb2.DraftResponse(session_id=req.session_id, step=step, position=at,
                                                tree=common_pb2.DraftTree(tokens=tokens, parents=parents),
                                                ahead=drafter_pb2.Ahead(accepted=[]))
            n = 70 if self.mode == "huge" else 12
            tree = common_pb2.DraftTree(tokens=[r.randrange(49152) for _ in range(n)],
                                        parents=[r.randrange(-1, i) if i else -1 for i in range(n)])
            if self.mode == "out-of-vocab":
                tree.tokens[0] = 10**7
            if self.mode == "cycle":
                tree.parents[0] = 5
            if self.mode == "wrong-step":
                step += 3
            if self.mode == "slow":
                time.sleep(0.5)
            if self.mode == "bad-q":
                tree.q.add(node=-1, ids=[1, 1], probs=[0.5, 0.5])
            yield drafter_pb2.DraftResponse(session_id=req.session_id, step=step, tree=tree)


@pytest.mark.parametrize("mode", ["random", "huge", "out-of-vocab", "cycle", "wrong-step", "slow", "bad-q", "push"])
def test_malicious_drafter_never_changes_output(local, verifier, mode):
    ids, expected = local[2][1]
    server = grpc.server(futures.ThreadPoolExecutor(4))
    drafter_pb2_grpc.add_DrafterServicer_to_server(BadDrafter(mode, ids + expected), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        deadline = verifier_pb2.SpeculationOptions(draft_deadline_s=0.2)
        out, complete = run(verifier.address, ids, drafter=f"127.0.0.1:{port}", speculation=deadline)
        assert out == expected
        s = complete.speculation
        assert s.rejected_trees + s.drafter_timeouts > 0 or mode in ("random", "push")
        if mode == "push":  # the verifier took the pushed garbage, verified it, and rejected it
            assert s.predraft_hits > 0 and s.accepted_tokens < s.drafted_tokens
        sampled, _ = run(verifier.address, ids, drafter=f"127.0.0.1:{port}", speculation=deadline, ignore_eos=True,
                         sampling=common_pb2.SamplingParams(temperature=0.7, seed=3))
        assert len(sampled) == N  # sampling without a valid q: trees rejected, generation goes on
    finally:
        server.stop(0)


def test_graceful_shutdown(local):
    ids = local[2][0][0]
    v = start("verifier_service", "--threads", "1", "--grace-s", "2")
    box: dict = {}

    def consume():
        try:
            box["out"] = run(v.address, ids, max_tokens=400, ignore_eos=True)
        except grpc.RpcError as e:
            box["code"] = e.code()

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(3)
    t0 = time.monotonic()
    rc = v.stop(timeout=60)
    t.join(60)
    assert not t.is_alive(), "the client stream hung"
    assert rc == 0 and time.monotonic() - t0 < 30
    assert "out" in box or box["code"] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
