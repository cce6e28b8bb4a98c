"""Tests for specmesh.tp (sharding) and verifier_service.tp_group (a TP group of real processes).

- `apply_tp` splits heads by whole GQA groups, unevenly where it must (9 query / 3 K/V heads over
  2 ranks: 6+3 / 2+1), and the MLP as evenly as possible; N sharded copies run in threads with an
  in-process all-reduce give the unsharded model's logits (Llama and Qwen2 with q/k/v biases,
  2 and 3 ranks); too many ranks for the K/V heads is a ValueError.
- A real TP=2 group (gloo on 127.0.0.1, a worker process) over tiny random Llama and Qwen2 models:
  logits within 1e-4 of one rank for prefill and a tree step, greedy generation token-identical
  with and without a drafter, sessions interleaved or in concurrent threads stay correct; several
  sessions' forwards as one BATCH op equal each alone to the bit, and concurrent sessions through
  `specmesh.batching` over the group generate what each does alone.
- Shutdown reaps every worker; a killed or stalled worker makes calls fail with TPGroupError
  instead of hanging rank 0.
- slow: the bundled SmolLM2 at TP=2 (its 3 K/V heads split 2+1) generates exactly what one rank does.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from specmesh.drafters import NgramDrafter
from specmesh.engine import StopConditions, generate, generate_stream
from specmesh.loader import bundled_target_path, load_model, load_tokenizer, model_from_hf
from specmesh.batching import BatchingTarget
from specmesh.model import ModelConfig, Segment, Transformer
from specmesh.runtime import encode_prompt
from specmesh.sampling import SamplingParams
from specmesh.tp import apply_tp, shard_sizes
from specmesh.tree import depths, tree_attention_mask
from verifier_service.tp_group import TPCache, TPGroupError, TPModel, start_tp
from tests.tiny_models import random_hf_model

TOL = 1e-4
VOCAB = 256
GREEDY = SamplingParams()
PROMPT = [5, 17, 33, 2, 9, 5, 17, 33, 2, 9, 5, 17, 33, 2, 9, 5, 17]  # repeats: the n-gram drafter drafts
PARENTS = [-1, -1, 0, 0, 2, 1]  # a tree with siblings at two depths


@pytest.fixture(autouse=True)
def _one_thread():
    """start_tp sets this process's thread count (rank 0's budget); give the other tests theirs back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _hf_model(family: str, heads: int = 4, kv_heads: int = 2, intermediate: int = 128, seed: int = 0):
    """A seeded random transformers model with O(1) logits (norms and biases far from default)."""
    kind = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    cfg = kind(vocab_size=VOCAB, hidden_size=16 * heads, intermediate_size=intermediate, num_hidden_layers=2,
               num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
               tie_word_embeddings=False)
    return random_hf_model(cfg, seed)


def _prefill_and_tree(model: Transformer | TPModel, capacity: int = 64) -> torch.Tensor:
    """Logits of a prefill, a tree step (as TargetSession.step builds it), and a decode after
    committing one tree path (moved slots): [len(PROMPT) + 1 + len(PARENTS) + 1, vocab]."""
    prompt = PROMPT
    cache = model.new_cache(capacity)
    n = len(prompt)
    rows = [model(torch.tensor(prompt), torch.arange(n), cache, 0)]  # [n, V]
    cache.commit(list(range(n - 1)))  # the last prompt token stays pending, as in the engine
    start, k = n - 1, len(PARENTS)
    toks = torch.tensor([prompt[-1]] + [7, 8, 9, 10, 11, 12])  # [1 + k]
    pos = torch.tensor([0] + depths(PARENTS)) + start
    mask = torch.ones(1 + k, start + 1 + k, dtype=torch.bool)  # [1 + k, S]
    mask[0, start + 1:] = False
    mask[1:, start + 1:] = tree_attention_mask(PARENTS)
    rows.append(model(toks, pos, cache, start, mask))  # [1 + k, V]
    cache.commit([start, start + 1 + 0, start + 1 + 2, start + 1 + 4])  # pending + path 0 -> 2 -> 4
    at = cache.length
    rows.append(model(torch.tensor([3]), torch.tensor([at]), cache, at))  # [1, V]
    return torch.cat(rows)


def _in_threads(target, prompts: list[list[int]], stop: StopConditions) -> list[object]:
    """Greedy generations with the n-gram drafter, one thread per prompt at once: their token ids
    (or the exception one raised)."""
    got: list[object] = [None] * len(prompts)

    def run(i: int) -> None:
        try:
            got[i] = generate(target, prompts[i], GREEDY, stop, NgramDrafter()).token_ids
        except BaseException as e:  # surfaced by the caller's assert
            got[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert want.std() > 0.3, "reference logits too flat for the tolerance to mean anything"
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.3g} > {TOL}"


def _tp_children() -> list[int]:
    """Pids of this process's children running a TP worker (from /proc, not from TPModel)."""
    me, found = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        if ppid == me and b"verifier_service.tp_group" in cmd:
            found.append(int(d.name))
    return found


# --- sharding, in one process -------------------------------------------------------------------


@pytest.mark.parametrize("n,world,want", [
    (3, 2, [2, 1]), (9, 2, [5, 4]), (1536, 2, [768, 768]), (100, 3, [34, 33, 33]), (4, 4, [1, 1, 1, 1]),
    (3, 1, [3]), (2, 3, [1, 1, 0]),
])
def test_shard_sizes(n, world, want):
    assert shard_sizes(n, world) == want


def test_shard_sizes_rejects_no_ranks():
    with pytest.raises(ValueError, match="world"):
        shard_sizes(4, 0)


def _smol_like(kv_heads: int = 3) -> Transformer:
    """SmolLM2-135M's head layout (9 query / 3 K/V heads) at a tiny width."""
    cfg = ModelConfig(vocab_size=64, hidden_size=72, intermediate_size=100, num_layers=2, num_heads=9,
                      num_kv_heads=kv_heads, head_dim=8, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      attention_bias=False, max_position_embeddings=128)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    return Transformer(cfg, inv_freq).eval()


def test_apply_tp_splits_whole_gqa_groups_unevenly():
    d = 8
    for rank, (q, kv, ff) in enumerate([(6, 2, 50), (3, 1, 50)]):
        model = _smol_like()
        embed = model.model.embed_tokens.weight
        apply_tp(model, rank, 2, all_reduce=lambda x: x)
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            assert attn.q_proj.weight.shape == (q * d, 72)
            assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (kv * d, 72)
            assert attn.o_proj.weight.shape == (72, q * d)
            assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (ff, 72)
            assert mlp.down_proj.weight.shape == (72, ff)
        assert model.model.embed_tokens.weight is embed and model.lm_head.weight is embed  # replicated
        assert model.new_cache(4).k.shape[1] == kv
        assert model.config.num_heads == 9, "the config keeps the global sizes"


def test_apply_tp_needs_a_kv_head_per_rank():
    model = _smol_like(kv_heads=1)  # 9 query heads sharing one K/V head: it cannot be split
    with pytest.raises(ValueError, match="only 1 K/V heads"):
        apply_tp(model, 0, 2, all_reduce=lambda x: x)
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == 72, "refused before touching weights"


class _ThreadAllReduce:
    """Sums a tensor across N threads (one per rank), in the same order on every rank."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=30)
        self.parts: list[torch.Tensor | None] = [None] * world

    def for_rank(self, rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x.clone()
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)
            self.barrier.wait()  # nobody overwrites a part before every rank has summed
            return total
        return all_reduce


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_ranks_compute_the_unsharded_logits(family, world):
    """6 query / 3 K/V heads and MLP width 100: uneven head groups (world 2) and MLP (world 3)."""
    hf = _hf_model(family, heads=6, kv_heads=3, intermediate=100)
    want = _prefill_and_tree(model_from_hf(hf.config, hf.state_dict()))
    reduce = _ThreadAllReduce(world)
    ranks = [apply_tp(model_from_hf(hf.config, hf.state_dict()), r, world, reduce.for_rank(r)) for r in range(world)]
    got: list[torch.Tensor | BaseException | None] = [None] * world

    def run(r: int) -> None:
        try:
            got[r] = _prefill_and_tree(ranks[r])
        except BaseException as e:  # surfaced below, on the main thread
            got[r] = e
            reduce.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in got:
        if isinstance(r, BaseException):
            raise r
    for r in range(world):
        _assert_close(got[r], want)  # every rank holds the whole logits (lm_head replicated)


# --- a real TP group: tiny random models ---------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Llama and Qwen2 (q/k/v biases) saved with save_pretrained: 4 query / 2 K/V heads."""
    out = {}
    for family in ("llama", "qwen2"):
        path = tmp_path_factory.mktemp(family)
        _hf_model(family).save_pretrained(path)
        out[family] = path
    return out


@pytest.fixture(scope="class", params=["llama", "qwen2"])
def pair(request, saved):
    """(one-rank model, TP=2 group) over the same weights."""
    path = saved[request.param]
    tp = start_tp(path, 2, timeout_s=30)
    yield load_model(path), tp
    tp.shutdown()


class TestTwoRanks:
    def test_logits_match_one_rank(self, pair):
        one, tp = pair
        assert tp.world_size == 2 and tp.model.model.layers[0].self_attn.k_proj.weight.shape[0] == 16
        _assert_close(_prefill_and_tree(tp, capacity=8), _prefill_and_tree(one))  # TP: grown in forwards

    @pytest.mark.parametrize("drafter", [None, NgramDrafter()], ids=["none", "ngram"])
    def test_greedy_generation_is_identical(self, pair, drafter):
        one, tp = pair
        stop = StopConditions(max_new_tokens=24)
        want = generate(one, PROMPT, GREEDY, stop, drafter)
        got = generate(tp, PROMPT, GREEDY, stop, drafter)
        assert got.token_ids == want.token_ids and len(want.token_ids) == 24
        if drafter is not None:
            assert got.stats.drafted_tokens > 0, "the drafter must have proposed trees to verify"

    def test_interleaved_sessions_stay_separate(self, pair):
        one, tp = pair
        prompts = [PROMPT, [40, 41, 42, 40, 41, 42, 40]]
        stop = StopConditions(max_new_tokens=16)
        want = [generate(one, p, GREEDY, stop, NgramDrafter()).token_ids for p in prompts]
        streams = [generate_stream(tp, p, GREEDY, stop, NgramDrafter()) for p in prompts]
        got: list[list[int]] = [[], []]
        live = [0, 1]
        while live:  # one step of each session in turn, over the same group
            for i in list(live):
                step = next(streams[i], None)
                if step is None:
                    live.remove(i)
                else:
                    got[i].extend(step)
        assert got == want

    def test_concurrent_sessions_in_threads(self, pair):
        one, tp = pair
        prompts = [PROMPT, [40, 41, 42, 40, 41, 42, 40], [1, 2, 3], [200, 100, 200, 100]]
        stop = StopConditions(max_new_tokens=12)
        want = [generate(one, p, GREEDY, stop, NgramDrafter()).token_ids for p in prompts]
        assert _in_threads(tp, prompts, stop) == want
        assert tp.healthy

    def test_bad_input_is_refused_and_the_group_stays_usable(self, pair):
        one, tp = pair
        cache = tp.new_cache()
        with pytest.raises(ValueError, match="mask"):
            tp(torch.tensor([1, 2]), torch.arange(2), cache, 0, torch.ones(2, 3, dtype=torch.bool))
        with pytest.raises(ValueError, match="not a cache"):
            tp(torch.tensor([1]), torch.arange(1), one.new_cache(), 0)
        cache.close()
        with pytest.raises(ValueError, match="closed"):
            tp(torch.tensor([1]), torch.arange(1), cache, 0)
        _assert_close(_prefill_and_tree(tp), _prefill_and_tree(one))


@pytest.fixture(scope="class", params=["llama", "qwen2"])
def invariant_group(request, saved):
    """A TP=2 group whose every product is the small-M kernel's: the workers started with
    SPECMESH_KERNELS=1, rank 0's (this process's) timed dispatch table set aside by `kernel_only`.
    Batch invariance is the kernel's; a machine whose timed table sends some shape to torch's GEMM
    has the verifier leave batching off (verifier_service.server.load_target)."""
    before = os.environ.get("SPECMESH_KERNELS")
    os.environ["SPECMESH_KERNELS"] = "1"
    try:
        tp = start_tp(saved[request.param], 2, timeout_s=30)
    finally:
        if before is None:
            del os.environ["SPECMESH_KERNELS"]
        else:
            os.environ["SPECMESH_KERNELS"] = before
    yield tp
    tp.shutdown()


@pytest.mark.usefixtures("kernel_only")
class TestBatchedTwoRanks:
    def test_a_batched_forward_gives_each_session_its_own_forward(self, invariant_group):
        # three sessions' steps (a tree, a decode, a prefill) as one BATCH op equal, to the bit,
        # each run alone over the same group: how specmesh.batching verifies sessions at TP > 1
        tp = invariant_group
        prompts = [PROMPT, [40, 41, 42, 40, 41, 42, 40], [1, 2, 3, 4]]

        def step(cache, prompt, i) -> Segment:  # session i's next forward
            n = len(prompt)
            if i == 0:  # a tree after the pending token
                start = n - 1
                mask = torch.ones(1 + len(PARENTS), start + 1 + len(PARENTS), dtype=torch.bool)
                mask[0, start + 1:] = False
                mask[1:, start + 1:] = tree_attention_mask(PARENTS)
                pos = torch.tensor([0] + depths(PARENTS)) + start
                return Segment(torch.tensor([prompt[-1], 7, 8, 9, 10, 11, 12]), pos, cache, start, mask)
            if i == 1:  # one-token decode
                return Segment(torch.tensor([prompt[-1]]), torch.tensor([n - 1]), cache, n - 1)
            return Segment(torch.tensor([5, 6]), torch.tensor([n - 1, n]), cache, n - 1)  # two rows, causal

        def prefilled():
            caches = []
            for p in prompts:
                c = tp.new_cache(64)
                tp(torch.tensor(p[:-1]), torch.arange(len(p) - 1), c, 0, logits_rows=None)
                c.commit(list(range(len(p) - 1)))
                caches.append(c)
            return caches

        alone = [tp(s.tokens, s.positions, s.cache, s.start, s.mask)
                 for s in (step(c, p, i) for i, (c, p) in enumerate(zip(prefilled(), prompts)))]
        batch = [step(c, p, i) for i, (c, p) in enumerate(zip(prefilled(), prompts))]
        together = tp.forward_batch(batch)
        assert all(torch.equal(a, t) for a, t in zip(alone, together))
        with pytest.raises(ValueError, match="mask"):  # bad input: refused before any rank runs it
            tp.forward_batch([Segment(torch.tensor([1, 2]), torch.arange(2), tp.new_cache(), 0,
                                      torch.ones(2, 3, dtype=torch.bool))])
        with pytest.raises(ValueError, match="twice"):
            c = prefilled()[0]
            tp.forward_batch([Segment(torch.tensor([1]), torch.tensor([16]), c, 16)] * 2)
        assert tp.healthy

    def test_concurrent_sessions_batched_generate_what_each_does_alone(self, invariant_group):
        tp = invariant_group
        prompts = [PROMPT, [40, 41, 42, 40, 41, 42, 40], [1, 2, 3], [200, 100, 200, 100]]
        stop = StopConditions(max_new_tokens=12)
        want = [generate(tp, p, GREEDY, stop, NgramDrafter()).token_ids for p in prompts]
        bt = BatchingTarget(tp, gather_s=0.05)
        assert _in_threads(bt, prompts, stop) == want
        assert bt.stats.max_segments >= 2, "concurrent sessions should have shared forwards"
        assert bt.healthy and bt.world_size == 2  # the group's own attributes, through the wrapper


def test_one_rank_needs_no_group(saved):
    tp = start_tp(saved["llama"], 1)
    assert tp.world_size == 1 and tp.worker_pids == [] and isinstance(tp.new_cache(), TPCache)
    stop = StopConditions(max_new_tokens=12)
    assert generate(tp, PROMPT, GREEDY, stop).token_ids == generate(load_model(saved["llama"]), PROMPT, GREEDY,
                                                                    stop).token_ids
    tp.shutdown()


def test_start_refuses_more_ranks_than_kv_heads(saved):
    with pytest.raises(ValueError, match="only 2 K/V heads"):
        start_tp(saved["llama"], 3)
    assert _tp_children() == []


def test_shutdown_leaves_no_child_processes(saved):
    tp = start_tp(saved["qwen2"], 2, timeout_s=30)
    pids = tp.worker_pids
    assert _tp_children() == pids
    tp(torch.tensor([1, 2, 3]), torch.arange(3), tp.new_cache(), 0)
    tp.shutdown()
    tp.shutdown()  # idempotent
    assert _tp_children() == []
    assert [p.returncode for p in tp._workers] == [0], "workers stop cleanly on STOP"
    with pytest.raises(TPGroupError, match="shut down"):
        tp.new_cache()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
def test_lost_worker_fails_calls_instead_of_hanging(saved, sig):
    """A killed worker is noticed before the next op; a stalled one once the collective times out."""
    timeout_s = 5.0  # short, but long enough that a busy machine's scheduling never trips it
    tp = start_tp(saved["llama"], 2, timeout_s=timeout_s)
    try:
        cache = tp.new_cache()
        tp(torch.tensor([1, 2, 3]), torch.arange(3), cache, 0)
        os.kill(tp.worker_pids[0], sig)
        if sig == signal.SIGKILL:
            os.waitid(os.P_PID, tp.worker_pids[0], os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
        t0 = time.monotonic()
        with pytest.raises(TPGroupError):
            tp(torch.tensor([4]), torch.tensor([3]), cache, 3)
        assert time.monotonic() - t0 < timeout_s + 15
        assert not tp.healthy
        t0 = time.monotonic()
        with pytest.raises(TPGroupError):  # broken for good, and says so at once
            tp.new_cache()
        assert time.monotonic() - t0 < 1
    finally:
        tp.shutdown()
    assert _tp_children() == []


# --- the bundled SmolLM2 -------------------------------------------------------------------------


@pytest.mark.slow  # two processes each load SmolLM2-135M (~5-10 s on 2 busy cores)
def test_bundled_smollm2_two_ranks_generate_what_one_rank_does():
    path = bundled_target_path()
    one = load_model(path)
    ids = encode_prompt(load_tokenizer(path), "List three uses of copper, briefly.", chat=True)
    stop = StopConditions(max_new_tokens=16)
    want = generate(one, ids, GREEDY, stop).token_ids
    with start_tp(path, 2) as tp:
        attn = tp.model.model.layers[0].self_attn
        assert (attn.k_proj.weight.shape[0], attn.q_proj.weight.shape[0]) == (2 * 64, 6 * 64)  # rank 0 of 2+1
        assert generate(tp, ids, GREEDY, stop).token_ids == want
        assert generate(tp, ids, GREEDY, stop, NgramDrafter()).token_ids == want
