"""Tests for specmesh.kv_cache: growth, write/view, commit of scratch slots, truncate.

Every slot gets a distinct literal value (its own index, plus 1000 * layer for K and a negative
sign for V), so a test can say exactly which slot ended up where.
"""

from __future__ import annotations

import pytest
import torch

from specmesh.kv_cache import MIN_CAPACITY, KVCache

LAYERS, HEADS, DIM = 2, 3, 4


def _kv(layer: int, values: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V `[H_kv, T, D]` whose slot t holds values[t] (+ 1000 * layer) in every head and lane."""
    base = torch.tensor(values, dtype=torch.float32) + 1000 * layer  # [T]
    k = base[None, :, None].expand(HEADS, len(values), DIM).clone()
    return k, -k


def _filled(capacity: int, values: list[int]) -> KVCache:
    """A cache whose slots [0, len(values)) hold `values` in every layer; nothing committed."""
    cache = KVCache(LAYERS, HEADS, DIM, capacity)
    cache.ensure_capacity(len(values))
    for layer in range(LAYERS):
        cache.write(layer, 0, *_kv(layer, values))
    return cache


def _slots(cache: KVCache, end: int) -> list[list[int]]:
    """Per layer, the slot values of [0, end), read back through `view`; checks K, V, heads agree."""
    out = []
    for layer in range(LAYERS):
        k, v = cache.view(layer, end)  # [H_kv, end, D] each
        assert k.shape == v.shape == (HEADS, end, DIM)
        assert torch.equal(v, -k)
        assert torch.equal(k, k[:1, :, :1].expand_as(k)), "heads and lanes must hold the same value"
        out.append([int(x) - 1000 * layer if x else 0 for x in k[0, :, 0].tolist()])  # 0: unwritten
    return out


def test_new_cache_is_empty_and_zeroed():
    cache = KVCache(LAYERS, HEADS, DIM, capacity=8)
    assert cache.length == 0 and cache.capacity == 8
    assert cache.k.shape == (LAYERS, HEADS, 8, DIM)
    assert not cache.k.any() and not cache.v.any()


def test_write_then_view_reads_back_per_layer():
    cache = KVCache(LAYERS, HEADS, DIM, capacity=8)
    for layer in range(LAYERS):
        cache.write(layer, 2, *_kv(layer, [7, 8, 9]))
    assert _slots(cache, 5) == [[0, 0, 7, 8, 9]] * LAYERS
    assert cache.length == 0, "writing scratch slots commits nothing"


def test_view_is_a_view_not_a_copy():
    cache = _filled(8, [1, 2, 3])
    k, _ = cache.view(0, 3)
    cache.write(0, 1, *_kv(0, [5]))
    assert k[0, :, 0].tolist() == [1, 5, 3]


def test_write_past_capacity_asserts():
    cache = KVCache(LAYERS, HEADS, DIM, capacity=4)
    with pytest.raises(AssertionError, match="ensure_capacity"):
        cache.write(0, 3, *_kv(0, [1, 2]))


@pytest.mark.parametrize(
    "capacity,needed,expected",
    [
        (8, 8, 8),  # already enough: unchanged
        (8, 3, 8),
        (8, 9, MIN_CAPACITY),  # small caches grow to the minimum at once
        (300, 301, 600),  # doubling
        (300, 1000, 1000),  # more than double needed: exactly what is needed
    ],
)
def test_ensure_capacity_grows_by_doubling(capacity, needed, expected):
    cache = KVCache(LAYERS, HEADS, DIM, capacity)
    cache.ensure_capacity(needed)
    assert cache.capacity == expected
    assert cache.k.shape == cache.v.shape == (LAYERS, HEADS, expected, DIM)


def test_ensure_capacity_keeps_contents_and_length():
    cache = _filled(4, [1, 2, 3, 4])
    cache.commit([0, 1, 2])
    cache.ensure_capacity(5)
    assert cache.capacity >= 8
    assert cache.length == 3
    assert _slots(cache, 6) == [[1, 2, 3, 4, 0, 0]] * LAYERS


@pytest.mark.parametrize(
    "length,slots,expected",
    [
        # a committed prefix [10, 11], scratch slots 2..7 hold 12..17
        (2, [2, 3, 4], [10, 11, 12, 13, 14]),  # contiguous: nothing moves
        (2, [3, 5, 6], [10, 11, 13, 15, 16]),  # gaps: gathered down, in order
        (2, [3, 4], [10, 11, 13, 14]),  # source and destination overlap
        (2, [7], [10, 11, 17]),
        (2, [2, 6], [10, 11, 12, 16]),  # the first slot stays, the next moves
        (0, [1, 4], [11, 14]),  # nothing committed yet
    ],
)
def test_commit_moves_exactly_the_given_slots_in_order(length, slots, expected):
    cache = _filled(8, list(range(10, 18)))
    if length:
        cache.commit(list(range(length)))
    cache.commit(slots)
    assert cache.length == len(expected)
    assert _slots(cache, cache.length) == [expected] * LAYERS


def test_commit_nothing_is_a_no_op():
    cache = _filled(8, list(range(10, 18)))
    cache.commit([0, 1])
    cache.commit([])
    assert cache.length == 2
    assert _slots(cache, 8) == [list(range(10, 18))] * LAYERS


def test_successive_commits_append():
    cache = _filled(8, list(range(10, 18)))
    cache.commit([0, 2])  # -> [10, 12]
    cache.commit([3, 5])  # -> [10, 12, 13, 15]
    cache.commit([4])  # contiguous again: slot 4 keeps its own 14
    assert cache.length == 5
    assert _slots(cache, 5) == [[10, 12, 13, 15, 14]] * LAYERS


@pytest.mark.parametrize("slots", [[1], [2, 1], [0, 3]])
def test_commit_below_length_asserts(slots):
    cache = _filled(8, list(range(10, 18)))
    cache.commit([0, 1])
    with pytest.raises(AssertionError, match="scratch"):
        cache.commit(slots)
    assert cache.length == 2


def test_commit_past_capacity_asserts():
    cache = _filled(8, list(range(10, 18)))
    with pytest.raises(AssertionError):
        cache.commit([0, 8])


@pytest.mark.parametrize("to", [0, 2, 4])
def test_truncate_forgets_the_tail_and_the_next_commit_overwrites_it(to):
    cache = _filled(8, list(range(10, 18)))
    cache.commit([0, 1, 2, 3])
    cache.truncate(to)
    assert cache.length == to
    cache.commit([6])
    assert cache.length == to + 1
    assert _slots(cache, to + 1) == [list(range(10, 10 + to)) + [16]] * LAYERS


@pytest.mark.parametrize("to", [-1, 5])
def test_truncate_outside_committed_range_asserts(to):
    cache = _filled(8, list(range(10, 18)))
    cache.commit([0, 1, 2, 3])
    with pytest.raises(AssertionError):
        cache.truncate(to)
    assert cache.length == 4
