"""Static-shape steps (specmesh.static_steps), the CPU twin of the GPU's captured steps: with one row
bucket a tree's rows equal one-token decoding to the bit in fp32 and bf16, so greedy speculation
through them is their plain decoding token for token; KV regions are fixed, reused and isolated;
bad input is refused and leaves the session usable."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from specmesh.batching import BatchingTarget
from specmesh.drafters import NgramDrafter, OracleDrafter
from specmesh.engine import SpecConfig, StopConditions, generate
from specmesh.model import Segment, Transformer
from specmesh.sampling import SamplingParams
from specmesh.static_steps import BUCKETS, StaticSteps
from specmesh.tree import depths, tree_attention_mask
from tests.tiny_models import tiny_transformer

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(dtype: torch.dtype = torch.float32, seed: int = 0) -> Transformer:
    return tiny_transformer(seed, weight_std=0.3).to(dtype)  # peaked: greedy chains an oracle can follow


def _prefilled(st: StaticSteps, ids: torch.Tensor):
    cache = st.new_cache()
    st(ids, torch.arange(len(ids)), cache, 0, logits_rows=None)
    cache.commit(list(range(len(ids))))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_bucket_tree_rows_equal_one_token_decoding(dtype):
    """A tree of 9 rows (the pending token and 8 nodes, two chunks of a 4-row bucket) gives each
    node's path, row for row, the logits that decoding that path one token at a time gives."""
    st = StaticSteps(_model(dtype), limit=64, sessions=4, buckets=(4,))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128, (11,), generator=g)
    pending = 7
    parents = [-1, 0, 1, -1, 3, 0, 4, 6]  # two branches and a fork
    nodes = torch.randint(0, 128, (len(parents),), generator=g).tolist()
    cache = _prefilled(st, prompt)
    start = cache.length
    mask = torch.ones(1 + len(parents), start + 1 + len(parents), dtype=torch.bool)
    mask[0, start + 1:] = False
    mask[1:, start + 1:] = tree_attention_mask(parents)
    pos = torch.tensor([0] + depths(parents)) + start
    tree = st(torch.tensor([pending] + nodes), pos, cache, start, mask)
    for i in range(len(parents)):
        path = [i]
        while parents[path[-1]] != -1:
            path.append(parents[path[-1]])
        ids = [pending] + [nodes[j] for j in reversed(path)]
        alone = _prefilled(st, prompt)
        for k, tok in enumerate(ids):
            out = st(torch.tensor([tok]), torch.tensor([start + k]), alone, start + k)
            alone.commit([start + k])
        assert torch.equal(out[0], tree[1 + i]), f"node {i}"
        alone.close()
    assert torch.equal(st(torch.tensor([pending]), torch.tensor([start]), cache, start)[0], tree[0])


def test_static_logits_match_the_dynamic_forward():
    """Same weights, same tokens: the static step attends in another order, so equal up to rounding."""
    m = _model()
    st = StaticSteps(m, limit=64, sessions=2, buckets=BUCKETS)
    ids = torch.randint(0, 128, (21,), generator=torch.Generator().manual_seed(2))
    cache = st.new_cache()
    logits, hidden = st(ids, torch.arange(21), cache, 0, hidden=True)
    ref, ref_hidden = m(ids, torch.arange(21), m.new_cache(64), 0, hidden=True)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-4, rtol=1e-4)
    assert st.report()["steps"] == {BUCKETS[-1]: 2}  # 21 rows: two chunks at the one bucket


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_speculation_is_plain_decoding_through_static_steps(dtype):
    """The engine's greedy output with an oracle drafter (fixed chains and planned shapes) and with
    the n-gram drafter is, token for token, plain decoding through the same static steps."""
    st = StaticSteps(_model(dtype, seed=3), limit=160, sessions=4, buckets=(8,))
    stop = StopConditions(max_new_tokens=40)
    for seed in range(3):
        prompt = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = generate(st, prompt, SamplingParams(), stop).token_ids
        oracle = OracleDrafter(prompt + plain, alpha=0.7, vocab_size=128, seed=seed)
        for drafter, spec in ((oracle, SpecConfig(budget=6, depth=3, fixed=True)), (oracle, SpecConfig()),
                              (NgramDrafter(), SpecConfig(budget=4, depth=4, fixed=True))):
            res = generate(st, prompt, SamplingParams(), stop, drafter=drafter, spec=spec)
            assert res.token_ids == plain, (seed, drafter.name, spec)
            if drafter is oracle and spec.fixed:
                assert res.stats.steps < 0.8 * len(plain)  # trees were accepted, not only decoded
    assert st.report()["steps"].keys() == {8}


def test_context_beyond_the_region_is_refused_and_the_session_goes_on():
    st = StaticSteps(_model(), limit=16, sessions=2, buckets=(4,))
    cache = _prefilled(st, torch.arange(1, 15))
    with pytest.raises(ValueError, match="context: 17 tokens exceed"):
        st(torch.tensor([1, 2, 3]), torch.arange(14, 17), cache, 14)
    with pytest.raises(ValueError, match="mask: expected shape"):
        st(torch.tensor([1]), torch.tensor([14]), cache, 14, mask=torch.ones(1, 3, dtype=torch.bool))
    out = st(torch.tensor([5, 6]), torch.arange(14, 16), cache, 14)  # the last two slots still serve
    assert out.shape == (2, 128) and torch.isfinite(out).all()


def test_a_chunked_forward_refuses_a_mask_that_sees_later_rows():
    st = StaticSteps(_model(), limit=32, sessions=1, buckets=(2,))
    cache = st.new_cache()
    mask = torch.ones(3, 3, dtype=torch.bool)  # row 0 sees rows 1 and 2: not computable in chunks
    with pytest.raises(ValueError, match="mask: a forward of more than 2 rows"):
        st(torch.tensor([1, 2, 3]), torch.arange(3), cache, 0, mask=mask)


def test_regions_are_fixed_reused_and_isolated():
    """Two regions: a third session waits for a closed or collected one; padding rows and other
    sessions never write into a session's region; the pool is allocated once."""
    st = StaticSteps(_model(), limit=32, sessions=2, buckets=(8,))
    pool = st.k.data_ptr()
    a = _prefilled(st, torch.arange(1, 6))
    before = a.k[:, :, :a.length].clone(), a.v[:, :, :a.length].clone()
    b = st.new_cache()
    with pytest.raises(RuntimeError, match="all 2 KV regions are in use"):
        st.new_cache()
    st(torch.arange(3), torch.arange(3), b, 0)  # 5 padding rows
    st(torch.arange(20), torch.arange(20), b, 0)  # chunks of 8, the last padded
    assert torch.equal(a.k[:, :, :a.length], before[0]) and torch.equal(a.v[:, :, :a.length], before[1])
    b.close()
    c = st.new_cache()
    assert c.region == b.region
    with pytest.raises(ValueError, match="cache: not an open region"):  # b's region is c's now
        st(torch.arange(3), torch.arange(3), b, 0)
    del a
    gc.collect()
    d = st.new_cache()  # a's region, given back when it was collected
    assert {c.region, d.region} == {0, 1} and st.k.data_ptr() == pool


def test_warmup_runs_every_bucket_and_reports():
    st = StaticSteps(_model(), limit=32, sessions=1, buckets=(2, 8))
    report = st.warmup()
    assert report["buckets"] == [2, 8] and report["graphs"] is False and report["captured"] == []
    assert report["steps"] == {} and report["pool_bytes"] == 2 * st.k.numel() * 4
    st(torch.tensor([3]), torch.tensor([0]), st.new_cache(), 0)  # the scratch region was given back
    assert st.report()["steps"] == {2: 1} and st.report()["padded_rows"] == 1


def test_cuda_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StaticSteps(_model(), limit=8, sessions=1, graphs=True)


def test_sessions_in_one_step_equal_each_alone():
    """Three sessions' rows (a tree, a decode, two prompt rows) as one 16-row step give each
    session, to the bit, what its own step gives, and K/V land in each one's own region."""
    st = StaticSteps(_model(), limit=48, sessions=6, buckets=(16,))
    prompts = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 14, 5)]
    parents = [-1, 0, -1, 2, 3]

    def segments(caches):
        tree_mask = torch.ones(6, 9 + 6, dtype=torch.bool)
        tree_mask[0, 10:] = False
        tree_mask[1:, 10:] = tree_attention_mask(parents)
        return [Segment(torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([0] + depths(parents)) + 9, caches[0], 9,
                        tree_mask, want_hidden=True),
                Segment(torch.tensor([11]), torch.tensor([14]), caches[1], 14),
                Segment(torch.tensor([12, 13]), torch.tensor([5, 6]), caches[2], 5, logits_rows=slice(-1, None))]

    together = segments([_prefilled(st, p) for p in prompts])
    outs = st.forward_batch(together)
    steps = st.report()["steps"][16]
    for i, seg in enumerate(segments([_prefilled(st, p) for p in prompts[:3]])):
        alone = st.forward_batch([seg])[0]
        assert torch.equal(alone, outs[i]), i
        if seg.want_hidden:
            assert torch.equal(seg.hidden, together[i].hidden)
        n = seg.tokens.shape[0]
        assert torch.equal(seg.cache.k[:, :, seg.start:seg.start + n],
                           together[i].cache.k[:, :, seg.start:seg.start + n])
    assert outs[2].shape == (1, 128) and st.report()["steps"][16] == steps + 3 + 3  # 3 prefills, 3 alone


def test_concurrent_sessions_through_batching_match_each_alone():
    """Greedy speculation of 4 sessions in 4 threads through BatchingTarget over the static steps
    (how a GPU verifier batches): each output is the session's own, and forwards were shared."""
    st = StaticSteps(_model(seed=5), limit=64, sessions=8, buckets=(16,))
    prompts = [[i + 1, 2 * i + 3, 5, 7 + i, 1, 2] for i in range(4)]
    stop = StopConditions(24)
    spec = SpecConfig(budget=3, depth=3, fixed=True)
    expected = [generate(st, p, SamplingParams(), stop).token_ids for p in prompts]
    bt = BatchingTarget(st, max_rows=st.buckets[-1], gather_s=0.05)
    out: list = [None] * 4
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(
        i, generate(bt, prompts[i], SamplingParams(), stop, drafter=NgramDrafter(), spec=spec).token_ids))
        for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out == expected
    assert bt.stats.max_segments > 1
