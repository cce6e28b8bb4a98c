"""The router's text of a turn from token ids: stops and held-back text (pure)."""

from __future__ import annotations

import pytest

from specmesh.text import Stops, TextStream, first_stop, visible


def letters(ids: list[int]) -> str:
    return "".join("abcdefghijklmnopqrstuvwxyz"[i] for i in ids)


@pytest.mark.parametrize("tokens, start, stops, expected", [
    ([0, 1, 2, 3], 0, Stops(ids=frozenset({2})), 3),           # stop id: kept, cut after it
    ([0, 1, 2, 3], 3, Stops(ids=frozenset({2})), None),        # before `start`: already checked
    ([0, 1, 2, 3], 0, Stops(strings=("bc",)), 3),              # string ends at the token that completes it
    ([0, 1, 2, 3], 2, Stops(strings=("bc",)), 3),              # straddling `start` still found
    ([0, 1, 2, 3], 0, Stops(strings=("zz",)), None),
])
def test_first_stop(tokens, start, stops, expected):
    assert first_stop(tokens, start, stops.ids, stops.strings, letters) == expected


@pytest.mark.parametrize("text, strings, final, expected", [
    ("hello wor", ("world",), False, "hello "),     # could still become the stop string: held back
    ("hello wor", ("world",), True, "hello wor"),   # final: nothing held
    ("hello world!", ("world",), False, "hello "),  # cut before the stop string
    ("caf\ufffd", (), False, "caf"),                # incomplete UTF-8 character held back
])
def test_visible(text, strings, final, expected):
    assert visible(text, strings, final) == expected


def test_text_stream_deltas_add_up():
    s = TextStream(letters, ("de",))
    deltas = [s.push([0, 1]), s.push([2, 3]), s.push([4, 5]), s.finish()]
    assert deltas == ["ab", "c", "", ""] and s.shown == "abc" and s.tokens == [0, 1, 2, 3, 4, 5]
