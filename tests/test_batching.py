"""Batched verification across sessions (specmesh.batching, Transformer.forward_batch): one forward
over several sessions' rows gives each session exactly what its own forward gives, concurrent
callers really share forwards, and one session's bad request fails only that session."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from specmesh.batching import BatchingTarget
from specmesh.engine import StopConditions, generate
from specmesh.model import Segment, Transformer, causal_mask
from specmesh.sampling import SamplingParams
from specmesh.tree import tree_attention_mask
from tests.tiny_models import tiny_transformer


pytestmark = pytest.mark.usefixtures("kernel_only")  # the bit-identity of batched rows is the kernel's


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_transformer()


def prefilled(model: Transformer, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=g)
    cache = model.new_cache(64)
    model(ids, torch.arange(n), cache, 0, logits_rows=None)
    cache.commit(list(range(n)))
    return cache


def tree_segment(cache, parents: list[int], tokens: list[int], rows) -> Segment:
    """A verification segment: the pending token + a tree, with the engine's mask and positions."""
    from specmesh.tree import depths

    start, n = cache.length, len(parents)
    mask = torch.ones(1 + n, start + 1 + n, dtype=torch.bool)
    mask[0, start + 1:] = False
    mask[1:, start + 1:] = tree_attention_mask(parents)
    pos = torch.tensor([0] + depths(parents)) + start
    return Segment(torch.tensor(tokens), pos, cache, start, mask, rows)


def clone(cache):
    c = type(cache).__new__(type(cache))
    c.k, c.v, c.length = cache.k.clone(), cache.v.clone(), cache.length
    return c


def test_forward_batch_equals_each_session_alone(model):
    caches = [prefilled(model, n, seed) for seed, n in enumerate((7, 20, 3))]
    alone_caches = [clone(c) for c in caches]

    def segments(cs):
        return [
            tree_segment(cs[0], [-1, 0, 0, 1], [5, 9, 17, 33, 2], slice(None)),       # tree of 4 nodes
            Segment(torch.tensor([11]), torch.tensor([cs[1].length]), cs[1], cs[1].length),  # one decode step
            Segment(torch.tensor([1, 2, 3]), torch.arange(3) + cs[2].length, cs[2], cs[2].length,
                    causal_mask(cs[2].length, 3), None),                              # prefill, no logits
        ]

    batched = model.forward_batch(segments(caches))
    alone = [model.forward_batch([s])[0] for s in segments(alone_caches)]
    assert batched[2] is None and alone[2] is None
    for b, a in zip(batched[:2], alone[:2]):
        assert b.shape == a.shape
        assert torch.equal(b, a)  # bit-identical: attention per session, batch-invariant linears
    for c, a in zip(caches, alone_caches):
        assert torch.equal(c.k, a.k) and torch.equal(c.v, a.v)


def held_batch(bt: BatchingTarget, calls: list) -> list:
    """Run `calls` (each: () -> result) in threads that all queue, in the order given, before any
    batch starts (each thread starts only once the one before it is queued: the order is the test's)."""
    results: list = [None] * len(calls)
    with bt._cv:
        bt._running = True  # as if a batch were running: every caller queues
    threads = []
    for i, call in enumerate(calls):
        def run(i=i, call=call):
            try:
                results[i] = call()
            except Exception as e:  # noqa: BLE001 - the test inspects it
                results[i] = e
        threads.append(threading.Thread(target=run))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while len(bt._queue) < i + 1:
            assert time.monotonic() < deadline
            time.sleep(0.002)
    with bt._cv:
        bt._running = False
        bt._cv.notify_all()
    for t in threads:
        t.join(30)
    return results


def test_queued_callers_share_one_forward(model):
    bt = BatchingTarget(model)
    caches = [prefilled(model, 5 + i, i) for i in range(4)]
    alone = [model(torch.tensor([3, 4]), torch.arange(2) + c.length, clone(c), c.length) for c in caches]
    calls = [lambda c=c: bt(torch.tensor([3, 4]), torch.arange(2) + c.length, c, c.length) for c in caches]
    got = held_batch(bt, calls)
    assert bt.stats.forwards == 1 and bt.stats.max_segments == 4  # 8 rows: one forward
    for g, a in zip(got, alone):
        assert torch.equal(g, a)


def test_batches_stop_at_max_rows_and_big_requests_run_alone(model):
    bt = BatchingTarget(model, max_rows=4)
    caches = [prefilled(model, 5, i) for i in range(4)]
    sizes = (3, 1, 2, 9)  # [3+1] [2] [9]: the head always goes, the rest only while they fit
    calls = [lambda c=c, n=n: bt(torch.arange(n) % 7, torch.arange(n) + c.length, c, c.length)
             for c, n in zip(caches, sizes)]
    got = held_batch(bt, calls)
    assert all(isinstance(g, torch.Tensor) for g in got)
    assert bt.stats.forwards == 3 and bt.stats.sizes == {2: 1, 1: 2}


def test_a_bad_request_fails_only_its_own_session(model):
    bt = BatchingTarget(model)
    good, bad = prefilled(model, 5, 0), prefilled(model, 5, 1)
    expected = model(torch.tensor([7]), torch.tensor([5]), clone(good), 5)
    got = held_batch(bt, [lambda: bt(torch.tensor([7]), torch.tensor([5]), good, 5),
                          lambda: bt(torch.tensor([10**6]), torch.tensor([5]), bad, 5)])
    assert torch.equal(got[0], expected)
    assert isinstance(got[1], IndexError)


def test_concurrent_generations_match_sequential_ones(model):
    """Greedy speculative-free decoding of 4 sessions in 4 threads through one BatchingTarget."""
    prompts = [[i + 1, 2 * i + 3, 5, 7 + i] for i in range(4)]
    stop = StopConditions(24)
    expected = [generate(model, p, SamplingParams(), stop).token_ids for p in prompts]
    bt = BatchingTarget(model)
    out: list = [None] * 4
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(
        i, generate(bt, prompts[i], SamplingParams(), stop).token_ids)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out == expected
    assert bt.stats.segments >= 4 * 24


def test_a_session_gone_idle_is_not_waited_for(model):
    """A forward waits up to `gather_s` for the other sessions active a moment ago; `idle` says one
    of them asks for nothing more (its turn ended), and a waiting forward goes on at once."""
    bt = BatchingTarget(model, gather_s=60.0)
    a, b = prefilled(model, 5, 0), prefilled(model, 5, 1)
    expected = model(torch.tensor([7]), torch.tensor([5]), clone(b), 5)
    bt(torch.tensor([7]), torch.tensor([5]), a, 5)  # a alone: never waits
    got: list = []
    t = threading.Thread(target=lambda: got.append(bt(torch.tensor([7]), torch.tensor([5]), b, 5)), daemon=True)
    t.start()
    t.join(0.5)
    assert not got, "b waits for a, which asked for a forward a moment ago"
    bt.idle(a)
    t.join(30)
    assert got and torch.equal(got[0], expected)
    bt(torch.tensor([8]), torch.tensor([6]), b, 6)  # b alone again: a was forgotten
