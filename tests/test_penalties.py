"""Penalties (presence, frequency, repetition, logit_bias, min_tokens) are part of the target
distribution and stay lossless under speculation: a chi-square test of sampled output against the
exact penalised Markov target (computed here independently, position by position), the same test
catching a penalizer that forgets a tree row's own path, and greedy output on the bundled SmolLM2
identical to transformers' `generate` with its own logits processors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specmesh import sampling
from specmesh.drafters.base import DraftGuide, TreeGuide, children_from_probs, drafter_probs, grow_tree
from specmesh.sampling import Penalizer, SamplingParams, sample_token, target_probs, verify_sampling
from tests.test_sampling import CHAIN3, P_ROOT, Q_ROOT, Q_TABLE, TABLE, WIDE, V, _Drafter, _p_value

CONTEXT = [1, 5]  # committed tokens before the turn: repetition sees them, presence/frequency not
STOP = 4
PARAMS = SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.6, repetition_penalty=1.8,
                        logit_bias=((3, 0.9),), min_tokens=2)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference_probs(raw_logits: np.ndarray, output: list[int], p: SamplingParams) -> np.ndarray:
    """The penalised next-token distribution after `output` (this turn's tokens so far), written
    out position by position from the formulas, independently of Penalizer."""
    x = raw_logits.astype(np.float64).copy()
    seen = set(CONTEXT) | set(output)
    for t in range(V):
        if t in seen and np.isfinite(x[t]):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        n = output.count(t)
        x[t] -= p.frequency_penalty * n + (p.presence_penalty if n else 0.0)
    for t, b in p.logit_bias:
        x[t] += b
    if len(output) < p.min_tokens:
        x[STOP] = -math.inf
    e = np.exp(x - x.max())
    return e / e.sum()


def _seq_probs(length: int, p: SamplingParams) -> np.ndarray:
    """Exact probability [V]*length of each sequence of the first `length` output tokens."""
    with np.errstate(divide="ignore"):
        log_root, log_table = np.log(P_ROOT.numpy()), np.log(TABLE.numpy())
    out = np.zeros((V,) * length)

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == length:
            out[tuple(prefix)] = prob
            return
        row = log_root if not prefix else log_table[prefix[-1]]
        for t, q in enumerate(_reference_probs(row, prefix, p)):
            if q > 0:
                walk(prefix + [t], prob * q)

    with np.errstate(divide="ignore"):
        walk([], 1.0)
    return out


def _run(parents: list[int], trials: int, length: int, p: SamplingParams, seed: int) -> np.ndarray:
    """Counts [V]*length of the first `length` output tokens: one verified tree, then plain steps."""
    drafter = _Drafter(seed, Q_ROOT)
    generator = torch.Generator().manual_seed(seed + 1)
    counts = np.zeros((V,) * length, dtype=np.int64)
    for _ in range(trials):
        pen = Penalizer(p, V, CONTEXT, frozenset([STOP]))
        _, out = _verify_then_decode(drafter.tree(parents), pen, p, generator, length)
        counts[tuple(out[:length])] += 1
    return counts


def _verify_then_decode(tree, pen: Penalizer, p: SamplingParams, generator: torch.Generator, length: int):
    """Verify `tree` against the penalised target, then sample plain steps up to `length` tokens:
    (the verification's result, the output)."""
    log_root, log_table = torch.log(P_ROOT), torch.log(TABLE)
    logits = torch.cat([log_root[None], log_table[tree.tokens]])  # [N+1, V]
    result = verify_sampling(tree, target_probs(pen(logits, tree.parents, tree.tokens), p), generator)
    out = result.tokens(tree)
    pen.add(out)
    while len(out) < length:
        row = target_probs(pen(log_table[out[-1]][None], [], []), p)[0]
        out.append(sample_token(row, generator))
        pen.add(out[-1:])
    return result, out


def _p_values(counts: np.ndarray, p: SamplingParams) -> list[float]:
    out = []
    for k in range(1, counts.ndim + 1):
        marginal = counts.sum(axis=tuple(range(k, counts.ndim)))
        out.append(_p_value(marginal, _seq_probs(k, p)))
    return out


@pytest.mark.parametrize("parents, length", [pytest.param(CHAIN3, 3, id="chain3"),
                                             pytest.param(WIDE, 2, id="wide3x2")])
def test_penalised_sampling_is_the_penalised_target_distribution(parents, length):
    counts = _run(parents, 20_000, length, PARAMS, seed=3)
    assert counts.ravel()[_seq_probs(length, PARAMS).ravel() == 0].sum() == 0, "a masked stop token came out"
    p_values = _p_values(counts, PARAMS)
    assert min(p_values) > 1e-3, p_values


def test_the_statistical_test_catches_a_penalizer_blind_to_the_path(monkeypatch):
    real = Penalizer.__call__

    def committed_only(self, logits, parents, tokens):  # every row penalised as if it were the root
        return real(self, logits, [-1] * len(parents), [0] * len(tokens))

    monkeypatch.setattr(sampling.Penalizer, "__call__", committed_only)
    counts = _run(CHAIN3, 8_000, 3, PARAMS, seed=3)
    assert min(_p_values(counts, PARAMS)) < 1e-6


def test_penalizer_rows_match_the_formulas_on_a_tree():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g)
    parents, tokens = [-1, 0, 1, -1], [3, 3, 2, 0]  # a chain repeating a token, and a second root child
    pen = Penalizer(PARAMS, V, CONTEXT, frozenset([STOP]))
    pen.add([2])  # one output token so far
    got = pen(logits, parents, tokens)
    paths = [[2], [2, 3], [2, 3, 3], [2, 3, 3, 2], [2, 0]]  # output + the row's path
    for row, output in enumerate(paths):
        want = torch.log(torch.from_numpy(_reference_probs(logits[row].numpy(), output, PARAMS)))
        assert torch.allclose(torch.log_softmax(got[row].double(), -1), want, atol=1e-5), row
    assert not PARAMS.greedy and SamplingParams().penalised is False


@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"), ({"min_tokens": -1}, "min_tokens"),
])
def test_bad_penalties_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs).validate()
    with pytest.raises(ValueError, match="^logit_bias: token id 99"):
        SamplingParams(logit_bias=((99, 1.0),)).check_vocab(V)


# --- the bundled SmolLM2: greedy identity with transformers' logits processors -------------------

@pytest.mark.slow
def test_penalised_greedy_identical_to_transformers_with_speculation():
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from specmesh.drafters import bundled_drafter_path
    from specmesh.drafters.model import ModelDrafter
    from specmesh.engine import SpecConfig, StopConditions, generate
    from specmesh.loader import bundled_target_path, resolve_folder
    from specmesh.runtime import encode_prompt, load_model_drafter, load_target

    torch.set_num_threads(2)
    model, tok = load_target(None)
    hf = AutoModelForCausalLM.from_pretrained(resolve_folder(bundled_target_path()), dtype=torch.float32).eval()
    ids = encode_prompt(tok, "List the days of the week, then the months of the year, one per line.", chat=True)
    eos = tok.eos_token_id
    n = 32

    class PresenceFrequency(LogitsProcessor):  # OpenAI's formula over the generated tokens
        def __init__(self, presence: float, frequency: float) -> None:
            self.presence, self.frequency = presence, frequency

        def __call__(self, input_ids, scores):
            counts = torch.zeros_like(scores)
            out = input_ids[:, len(ids):]
            counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
            return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)

    bias_token = tok.encode(" dog", add_special_tokens=False)[0]
    cases = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(logit_bias=((bias_token, 30.0),), min_tokens=n),
    ]
    for p in cases:
        kw = {}
        if p.repetition_penalty != 1.0:
            kw["repetition_penalty"] = p.repetition_penalty
        if p.logit_bias:
            kw["sequence_bias"] = {(t,): b for t, b in p.logit_bias}
        if p.min_tokens:
            kw["min_new_tokens"] = p.min_tokens
        procs = LogitsProcessorList([PresenceFrequency(p.presence_penalty, p.frequency_penalty)]
                                    if p.presence_penalty or p.frequency_penalty else [])
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=eos,
                              eos_token_id=eos, logits_processor=procs, **kw)[0, len(ids):].tolist()
        plain = generate(model, ids, SamplingParams(), StopConditions(n, frozenset([eos])))
        assert plain.token_ids != ref, f"{p}: the penalty changed nothing, so this case tests nothing"
        stop = StopConditions(n, frozenset([eos]))
        for drafter, spec in ((None, SpecConfig()), (ModelDrafter(model), SpecConfig(8, 4)),
                              (load_model_drafter(str(bundled_drafter_path())), SpecConfig(4, 4))):
            res = generate(model, ids, p, stop, drafter, spec)
            assert res.token_ids == ref, (p, type(drafter).__name__)
        if p.min_tokens:
            assert eos not in ref[: p.min_tokens]
        if p.logit_bias:
            assert bias_token in ref



def _run_drafted(guided: bool, budget: int, depth: int, trials: int, length: int, p: SamplingParams,
                 seed: int) -> tuple[np.ndarray, float]:
    """As `_run`, with trees grown by `grow_tree` from Q_ROOT / Q_TABLE as the drafter's logits; with
    `guided` the drafter's q carries the turn's penalties (`DraftGuide`). Counts and accepted
    draft tokens per step."""
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros((V,) * length, dtype=np.int64)
    q_root, q_table = torch.log(Q_ROOT).float(), torch.log(Q_TABLE).float()
    accepted = 0

    def expand(_nodes, paths, counts_):
        rows = [q_root if not path else q_table[path[-1]] for path in paths]
        return [children_from_probs(drafter_probs(x[None], p)[0], c, p, generator, logits=x)
                for x, c in zip(rows, counts_)]

    for _ in range(trials):
        pen = Penalizer(p, V, CONTEXT, frozenset([STOP]))
        guide = TreeGuide(DraftGuide(p, len(CONTEXT)), CONTEXT, [len(CONTEXT)], generator) if guided else None
        result, out = _verify_then_decode(grow_tree(expand, budget, depth, guide=guide), pen, p, generator, length)
        accepted += len(result.accepted)
        counts[tuple(out[:length])] += 1
    return counts, accepted / trials


@pytest.mark.parametrize("budget, depth, length", [pytest.param(3, 3, 3, id="chain3"),
                                                   pytest.param(6, 2, 2, id="wide6x2")])
def test_a_drafter_with_penalised_q_keeps_the_penalised_target_distribution(budget, depth, length):
    counts, _ = _run_drafted(True, budget, depth, 20_000, length, PARAMS, seed=4)
    p_values = _p_values(counts, PARAMS)
    assert min(p_values) > 1e-3, p_values


def test_penalising_the_drafters_q_raises_acceptance():
    _, unguided = _run_drafted(False, 3, 3, 4_000, 1, PARAMS, seed=6)
    _, guided = _run_drafted(True, 3, 3, 4_000, 1, PARAMS, seed=6)
    assert guided > unguided + 0.1, (guided, unguided)


@pytest.mark.slow
def test_a_self_drafter_with_the_penalties_in_its_q_accepts_more():
    """The target drafting for itself: with the turn's penalties in its q (the default) its trees
    are what the penalised target picks; without them it proposes what the raw target would."""
    from specmesh.drafters.model import ModelDrafter
    from specmesh.engine import GenerationResult, LocalDrafts, SpecConfig, StopConditions, TargetSession, run_turn
    from specmesh.runtime import encode_prompt, load_target
    from specmesh.sampling import make_generator

    torch.set_num_threads(2)
    model, tok = load_target(None)
    ids = encode_prompt(tok, "List the days of the week, then the months of the year, one per line.", chat=True)
    stop = StopConditions(32, frozenset([tok.eos_token_id]))
    bias = ((tok.encode(" dog", add_special_tokens=False)[0], 30.0),)
    for p in (SamplingParams(repetition_penalty=1.3), SamplingParams(logit_bias=bias)):
        runs = []
        for guided in (True, False):
            generator = make_generator(p)
            guide = DraftGuide(p, len(ids)) if guided else None
            source = LocalDrafts(ModelDrafter(model).open(ids), SpecConfig(8, 4), p, generator, guide)
            res = GenerationResult()
            for _ in run_turn(TargetSession(model, ids), source, p, generator, stop, None, res):
                pass
            runs.append(res)
        assert runs[0].token_ids == runs[1].token_ids
        assert runs[0].stats.tokens_per_step > runs[1].stats.tokens_per_step + 0.5, p
