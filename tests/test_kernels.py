"""The small-M CPU kernel: same products as torch, batch-invariant rows, a clean fallback, and the
dispatch by measurement (kernel or torch per weight shape, cached, greedy output unchanged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specmesh import kernels


def test_kernel_is_active_on_this_machine():
    """CI machines have a compiler and AVX2: the fast path must really be in use, not silently off."""
    if os.environ.get("SPECMESH_KERNELS") == "0":
        pytest.fail("SPECMESH_KERNELS=0 is set for the test run; the kernel tests need it on")
    assert kernels.load(), f"kernel unavailable: {kernels.reason()}"
    assert kernels.active()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 12])
@pytest.mark.parametrize("n,k", [(7, 13), (1001, 576), (64, 1536)])
def test_matches_torch_linear(m, n, k):
    kernels.load()
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    ref = F.linear(x.double(), w.double(), b.double())
    got = kernels.kernel_linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_do_not_depend_on_the_other_rows(threads):
    """Batch invariance: a row's output is bit-identical alone, in any batch, on any thread count."""
    kernels.load()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        x, w = torch.randn(kernels.SMALL_M_MAX, 576, generator=g), torch.randn(2050, 576, generator=g)
        alone = torch.cat([kernels.kernel_linear(x[i:i + 1], w) for i in range(x.shape[0])])
        for m in range(1, kernels.SMALL_M_MAX + 1):
            assert torch.equal(kernels.kernel_linear(x[:m], w), alone[:m]), m
        assert torch.equal(kernels.kernel_linear(x.flip(0), w), alone.flip(0))
    finally:
        torch.set_num_threads(before)


def test_concurrent_callers_and_a_forked_child_get_the_same_rows():
    """The kernel's own thread pool: callers on several threads at once (one uses the pool, the others
    run alone) and a forked child (none of the parent's workers) compute exactly the same rows."""
    import threading

    kernels.load()
    g = torch.Generator().manual_seed(7)
    w, xs = torch.randn(3001, 640, generator=g), [torch.randn(m, 640, generator=g) for m in (1, 3, 6, 17)]
    expected = [kernels.kernel_linear(x, w) for x in xs]
    got: list = [None] * len(xs)

    def run(i: int) -> None:
        got[i] = [kernels.kernel_linear(xs[i], w) for _ in range(20)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(y, e) for ys, e in zip(got, expected) for y in ys)
    pid = os.fork()
    if pid == 0:  # compared with numpy: torch's own OpenMP pool hangs in a forked child (a GNU OpenMP limit)
        same = all(kernels.kernel_linear(x, w).numpy().tobytes() == e.numpy().tobytes() for x, e in zip(xs, expected))
        os._exit(0 if same else 1)
    assert os.waitpid(pid, 0)[1] == 0


def test_large_batches_and_autograd_use_torch():
    kernels.load()
    x, w = torch.randn(kernels.SMALL_M_MAX + 1, 32), torch.randn(16, 32)
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))
    w.requires_grad_(True)
    y = kernels.linear(x[:2], w)
    y.sum().backward()  # the kernel has no autograd: training must go through torch
    assert w.grad is not None and torch.equal(w.grad, x[:2].sum(0).expand(16, 32))


def _probe(env: dict[str, str]) -> str:
    code = ("import torch, torch.nn.functional as F; from specmesh import kernels\n"
            "ok = kernels.load(); x, w = torch.randn(3, 40), torch.randn(9, 40)\n"
            "assert ok or torch.equal(kernels.linear(x, w), F.linear(x, w))\n"
            "print(ok, kernels.reason())\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() + "\n" + done.stderr


def test_disabled_by_environment():
    out = _probe({"SPECMESH_KERNELS": "0"})
    assert out.startswith("False disabled by SPECMESH_KERNELS=0"), out


def test_forced_by_environment_never_times():
    """SPECMESH_KERNELS=1: the kernel for every shape, no table: exact batch invariance whatever the speed."""
    code = ("import torch; from specmesh import kernels\n"
            "kernels.load(); kernels.tune(torch.nn.Sequential(torch.nn.Linear(64, 32)))\n"
            "d = kernels.describe(); print(d['mode'], d['batch_invariant'], d['shapes'])\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SPECMESH_KERNELS": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["forced", "True", "{}"], done.stdout
    assert "small-M kernel for" not in done.stderr  # nothing timed, nothing to report


def test_failed_build_falls_back_with_a_warning(tmp_path):
    """No usable compiler: torch's GEMM, and the user is told why (nothing cached, nothing broken)."""
    out = _probe({"SPECMESH_CACHE": str(tmp_path), "CXX": "false"})
    assert out.startswith("False false failed"), out
    assert "small-M kernel unavailable, using torch's GEMM" in out
    assert not list((tmp_path / "kernels").glob("*.so"))


# --- dispatch by measurement ---------------------------------------------------------------------

@pytest.fixture
def dispatch_state(tmp_path, monkeypatch):
    """This process's dispatch table, restored afterwards; tables go to tmp_path, never the user's cache."""
    assert kernels.load(), kernels.reason()
    st = kernels._State
    saved = (st.torch_shapes, st.entries, st.table, st.mode)
    monkeypatch.setattr(kernels, "library_path", lambda: tmp_path / "small_gemm-test.so")
    st.mode = "auto"
    st.torch_shapes, st.entries = frozenset(), {}  # only what this test tunes (earlier tests tuned models too)
    yield tmp_path
    st.torch_shapes, st.entries, st.table, st.mode = saved


def _linears(*shapes: tuple[int, int], copies: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(k, n, bias=i % 2 == 0) for n, k in shapes for i in range(copies)])


def test_slow_kernel_is_not_chosen_and_slow_torch_keeps_it(dispatch_state, monkeypatch, one_thread):
    """One thread: on a shared 2-core machine a 2-thread product waits for a busy core, for ms."""
    module = _linears((96, 256), (128, 512))
    # 20 ms: far above a tiny product's time even on a loaded machine (a descheduled call costs ~ms)
    monkeypatch.setenv("SPECMESH_KERNEL_TEST_DELAY_US", "20000")
    kernels.tune(module)
    d = kernels.describe()
    assert {s: e["choice"] for s, e in d["shapes"].items()} == {"96x256": "torch", "128x512": "torch"}
    assert not d["batch_invariant"]
    assert all(e["kernel_us"]["1"] > 20000 > e["torch_us"]["1"] for e in d["shapes"].values())
    monkeypatch.delenv("SPECMESH_KERNEL_TEST_DELAY_US")
    monkeypatch.setenv("SPECMESH_TORCH_TEST_DELAY_US", "20000")
    kernels.tune(module)  # another key (the delay is part of it): timed afresh
    d = kernels.describe()
    assert {s: e["choice"] for s, e in d["shapes"].items()} == {"96x256": "kernel", "128x512": "kernel"}
    assert d["batch_invariant"]
    assert len(list(dispatch_state.glob("dispatch-*.json"))) == 2


def test_linear_follows_the_table(dispatch_state, monkeypatch):
    module = _linears((96, 256), (80, 256))
    kernels.tune(module)
    kernels._State.torch_shapes = frozenset({(96, 256)})  # as if torch had won for this shape
    x = torch.randn(5, 256)
    w_torch, w_kernel = module[0].weight.detach(), module[2].weight.detach()
    assert torch.equal(kernels.linear(x, w_torch), F.linear(x, w_torch))
    assert torch.equal(kernels.linear(x, w_kernel), kernels.kernel_linear(x, w_kernel))
    untuned = torch.randn(7, 256)  # a shape no table holds (hand-built models, TP shards): the kernel
    assert torch.equal(kernels.linear(x, untuned), kernels.kernel_linear(x, untuned))


def test_table_is_cached_per_key_and_read_by_a_later_process(dispatch_state):
    from specmesh.kernels import dispatch

    lib = dispatch_state / "small_gemm-test.so"
    weights = dispatch.linear_weights(_linears((64, 128)))
    entries, path, spent = dispatch.tune_weights(weights, kernels.kernel_linear, lib)
    assert spent > 0 and path.is_file() and path.parent == lib.parent
    table = json.loads(path.read_text())
    assert table["key"]["threads"] == torch.get_num_threads() and table["key"]["cpu"] == dispatch.cpu_model()
    assert table["key"]["torch"] == torch.__version__ and "avx2" in table["key"]["flags"]
    assert sorted(map(int, table["shapes"]["64x128"]["kernel_us"])) == list(dispatch.TUNE_ROWS)
    code = ("import json, sys, torch; from pathlib import Path; from specmesh import kernels\n"
            "from specmesh.kernels import dispatch\n"
            f"torch.set_num_threads({torch.get_num_threads()}); kernels.load()\n"
            "w = dispatch.linear_weights(torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(128, 64)))\n"
            f"e, p, spent = dispatch.tune_weights(w, kernels.kernel_linear, Path({str(lib)!r}))\n"
            "print(json.dumps([e, str(p), spent]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    e, p, spent = json.loads(done.stdout)
    assert (e, p, spent) == (entries, str(path), 0.0)  # same key: the table, no timing
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before != 1 else 2)
    try:
        assert dispatch.table_path(lib, dispatch.table_key(lib)) != path  # threads are part of the key
    finally:
        torch.set_num_threads(before)


def test_choice_is_one_path_for_every_row_count():
    from specmesh.kernels import dispatch

    rows = {str(m): 100.0 for m in dispatch.TUNE_ROWS}
    entry = {"kernel_us": {**rows, "1": 50.0}, "torch_us": {**rows, "1": 60.0, "17": 10.0}}
    assert dispatch.choose(entry) == "torch"  # summed over the rows: torch; no per-row mixing
    entry["choice"] = "torch"
    # torch sums to 470 us; the per-row best (kernel at 1 row, torch elsewhere) to 460
    assert dispatch.per_m_gain(entry) == pytest.approx(1 - 460 / 470, abs=1e-3)
    near = {"kernel_us": dict(rows), "torch_us": {m: 97.0 for m in rows}}
    assert dispatch.choose(near) == "kernel"  # within MARGIN: the batch-invariant path stays


def test_a_model_takes_one_path_weighted_by_its_weights():
    """A model's shapes all take the path its weights, together, run faster on: a tiny shape that
    torch serves faster does not take torch's threads into a model the kernel serves."""
    from specmesh.kernels import dispatch

    def entry(kernel_us: float, torch_us: float) -> dict:
        return {"kernel_us": {str(m): kernel_us for m in dispatch.TUNE_ROWS},
                "torch_us": {str(m): torch_us for m in dispatch.TUNE_ROWS}}

    entries = {"8960x1536": entry(2000.0, 3000.0), "256x1536": entry(100.0, 60.0)}
    assert dispatch.choose(entries["256x1536"]) == "torch"
    assert dispatch.model_choice(entries, {"8960x1536": 56, "256x1536": 56}) == "kernel"
    assert dispatch.model_choice(entries, {"8960x1536": 1, "256x1536": 100}) == "torch"  # weights decide
    assert dispatch.model_choice({"256x1536": entry(100.0, 97.0)}, {"256x1536": 4}) == "kernel"  # within MARGIN


def test_tune_applies_the_models_choice_to_every_shape(dispatch_state, monkeypatch):
    from specmesh.kernels import dispatch

    module = _linears((96, 256), (80, 256))
    monkeypatch.setattr(dispatch, "model_choice", lambda entries, counts: "torch")
    kernels.tune(module)
    assert kernels._State.torch_shapes == {(96, 256), (80, 256)} and not kernels.describe()["batch_invariant"]
    monkeypatch.setattr(dispatch, "model_choice", lambda entries, counts: "kernel")
    kernels.tune(module)
    assert kernels._State.torch_shapes == frozenset() and kernels.describe()["batch_invariant"]
    shapes = kernels.describe()["shapes"]
    assert {e["choice"] for e in shapes.values()} == {"kernel"} and all("shape_choice" in e for e in shapes.values())


@pytest.fixture(scope="module")
def tiny_target():
    from transformers import LlamaConfig

    from specmesh.loader import model_from_hf
    from tiny_models import random_hf_model

    cfg = LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=1)
    return model_from_hf(cfg, random_hf_model(cfg, seed=5).state_dict())


def _shapes(model) -> frozenset:
    from specmesh.kernels import dispatch

    return frozenset(dispatch.linear_weights(model))


@pytest.mark.parametrize("path", ["kernel", "torch", "mixed"])
def test_greedy_output_identical_whichever_path_runs(tiny_target, dispatch_state, path):
    """Plain and speculative (tree-verified) greedy decoding give the kernel path's tokens, with
    every shape on the kernel, on torch, or split between them."""
    from specmesh.drafters import OracleDrafter
    from specmesh.engine import SpecConfig, StopConditions, generate
    from specmesh.sampling import SamplingParams

    shapes = sorted(_shapes(tiny_target))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 160, (n,), generator=g).tolist() for n in (5, 9, 14)]
    stop = StopConditions(24)
    kernels._State.torch_shapes = frozenset()
    expected = [generate(tiny_target, p, SamplingParams(), stop).token_ids for p in prompts]
    kernels._State.torch_shapes = {"kernel": frozenset(), "torch": frozenset(shapes),
                                   "mixed": frozenset(shapes[::2])}[path]
    for i, (p, exp) in enumerate(zip(prompts, expected)):
        assert generate(tiny_target, p, SamplingParams(), stop).token_ids == exp
        for spec in (SpecConfig(4, 4), SpecConfig(12, 4)):
            drafter = OracleDrafter(p + exp, 0.7, 160, seed=i)
            assert generate(tiny_target, p, SamplingParams(), stop, drafter, spec).token_ids == exp, (i, spec)


def test_batched_sessions_are_bit_identical_to_alone_on_the_kernel_path(tiny_target, dispatch_state):
    """With every shape on the kernel (`batch_invariant`), a session's logits do not depend on the
    sessions it shares a forward with: what specmesh.batching relies on. (A tree's rows and one-token
    decodes differ in the last bits on either path: attention over other row counts rounds
    differently; greedy identity there is the test above.)"""
    from specmesh.model import Segment

    kernels._State.torch_shapes = frozenset()
    assert kernels.describe()["batch_invariant"]
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(2, 160, (1,), generator=g), torch.randint(2, 160, (8,), generator=g)
    alone = [tiny_target.forward_batch([Segment(t, torch.arange(len(t)), tiny_target.new_cache(16), 0)])[0]
             for t in (a, b)]
    together = tiny_target.forward_batch([Segment(t, torch.arange(len(t)), tiny_target.new_cache(16), 0)
                                          for t in (a, b)])
    assert all(torch.equal(x, y) for x, y in zip(alone, together))
