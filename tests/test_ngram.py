"""The ngram drafter's search: continuations of the context's longest matching suffix, most recent
first, distinct; the same answers as the plain scan it replaced, at any context length."""

from __future__ import annotations

import random

import pytest

from specmesh.drafters.ngram import MAX_MATCHES, find_continuations


def scan(context: list[int], max_ngram: int, min_ngram: int, length: int) -> list[list[int]]:
    """The definition, spelled out: every earlier position, then the distinct non-empty ones."""
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        conts = [context[s + n:s + n + length] for s in range(n_ctx - n - 1, -1, -1)
                 if context[s:s + n] == context[n_ctx - n:]]
        distinct = [c for i, c in enumerate(conts) if c and c not in conts[:i]][:MAX_MATCHES]
        if distinct:
            return distinct
    return []


@pytest.mark.parametrize("context, expected", [
    ([5, 6, 7, 1, 5, 6], [[7, 1]]),               # "5 6" seen before: what followed it
    ([1, 2, 9, 1, 2, 8, 1, 2], [[8, 1], [9, 1]]),  # two earlier occurrences, most recent first
    ([4, 4, 4, 4], [[4]]),                          # the 3-gram occurs once before: only 1 token follows
    ([1, 2, 3], []),                                # nothing repeats
    ([7], []),
    ([], []),
])
def test_known_answers(context, expected):
    assert find_continuations(context, 3, 1, 2) == expected


def test_same_answers_as_the_plain_scan():
    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.randint(1, 6)  # small vocabularies: many matches, ties, MAX_MATCHES reached
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, 80))]
        hi = rng.randint(1, 4)
        lo, length = rng.randint(1, hi), rng.randint(1, 5)
        assert find_continuations(ctx, hi, lo, length) == scan(ctx, hi, lo, length), (ctx, hi, lo, length)


def test_long_context_finds_the_occurrence_near_its_start():
    rng = random.Random(1)
    ctx = [rng.randrange(1000, 40000) for _ in range(8000)]
    ctx[10:14] = [1, 2, 3, 4]
    ctx += [1, 2, 3]
    assert find_continuations(ctx, 3, 1, 4) == [[4] + ctx[14:17]]
