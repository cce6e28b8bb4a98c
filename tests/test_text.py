"""The router's text of a turn from token ids: stops and held-back text (pure)."""

from __future__ import annotations

import pytest

from specmesh.text import StopConditions, TextStream, first_stop, visible


def letters(ids: list[int]) -> str:
    return "".join("abcdefghijklmnopqrstuvwxyz"[i] for i in ids)


@pytest.mark.parametrize("tokens, start, stops, expected", [
    ([0, 1, 2, 3], 0, StopConditions(stop_ids=frozenset({2})), 3),      # stop id: kept, cut after it
    ([0, 1, 2, 3], 3, StopConditions(stop_ids=frozenset({2})), None),   # before `start`: already checked
    ([0, 1, 2, 3], 0, StopConditions(stop_strings=("bc",)), 3),         # string ends at the token that completes it
    ([0, 1, 2, 3], 2, StopConditions(stop_strings=("bc",)), 3),         # straddling `start` still found
    ([0, 1, 2, 3], 0, StopConditions(stop_strings=("zz",)), None),
])
def test_first_stop(tokens, start, stops, expected):
    assert first_stop(tokens, start, stops.stop_ids, stops.stop_strings, letters) == expected


@pytest.mark.parametrize("text, strings, final, expected", [
    ("hello wor", ("world",), False, "hello "),     # could still become the stop string: held back
    ("hello wor", ("world",), True, "hello wor"),   # final: nothing held
    ("hello world!", ("world",), False, "hello "),  # cut before the stop string
    ("caf\ufffd", (), False, "caf"),                # incomplete UTF-8 character held back
    ("aab", ("aabx",), False, ""),                  # the whole text may still become the stop
    ("xaa", ("aab",), False, "x"),                  # the longest end that begins it is held
    ("abab", ("abac",), False, "ab"),               # an earlier start that fails, a later one holds
    ("ab", ("b",), False, "a"),                     # one-character stop: cut, nothing to hold
])
def test_visible(text, strings, final, expected):
    assert visible(text, strings, final) == expected


def test_text_stream_deltas_add_up():
    s = TextStream(letters, ("de",))
    deltas = [s.push([0, 1]), s.push([2, 3]), s.push([4, 5]), s.finish()]
    assert deltas == ["ab", "c", "", ""] and s.shown == "abc" and s.tokens == [0, 1, 2, 3, 4, 5]


def test_text_stream_decodes_only_the_new_tokens_and_their_context():
    sizes = []

    def counting(ids):
        sizes.append(len(ids))
        return letters([i % 26 for i in ids])

    s = TextStream(counting)
    out = "".join(s.push([i]) for i in range(500)) + s.finish()
    assert out == letters([i % 26 for i in range(500)])
    assert max(sizes) <= 2  # the pushed token and the one before it, however long the text


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from specmesh.loader import bundled_target_path, load_tokenizer

    return load_tokenizer(bundled_target_path())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("stops", [(), ("ün",), ("\n\n",)])
def test_incremental_text_is_the_whole_decode(smollm2_tokenizer, seed, stops):
    """Multi-byte characters split across tokens (emoji, CJK, accents), leading spaces, newlines,
    pushed in random chunks: the deltas add up to what decoding the whole text shows, and every
    text shown on the way is a prefix of it."""
    import random

    tok = smollm2_tokenizer
    text = ("Grüße aus Köln! 你好，世界 🙂👍🏽 café\n\n  def f(x):\n    return x ** 2  # naïve\n"
            "Ünïcödé ✓ — done 🎉")
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    tokens = ids
    if seed == 3:  # chunks of 3 tokens scrambled: characters' bytes apart, invalid sequences
        chunks = [ids[i:i + 3] for i in range(0, len(ids), 3)]
        rng.shuffle(chunks)
        tokens = [t for c in chunks for t in c]

    def decode(x):
        return tok.decode(x, skip_special_tokens=True)

    s = TextStream(decode, stops)
    whole = visible(decode(tokens), stops, final=True)
    out, i = "", 0
    while i < len(tokens):
        n = rng.randint(1, 4)
        out += s.push(tokens[i:i + n])
        assert whole.startswith(s.shown)
        i += n
    out += s.finish()
    assert out == whole == s.shown


def test_held_text_against_every_prefix(seed: int = 0) -> None:
    """The held-back end is the longest end of the text that is a proper beginning of a stop
    string: checked against trying every prefix, on random texts over a small alphabet."""
    import random

    rng = random.Random(seed)
    for _ in range(2000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 8)))
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
        if stop in text:
            continue
        slow = max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        assert visible(text, (stop,), False) == text[:len(text) - slow], (text, stop)


def test_a_megabyte_stop_string_costs_what_the_text_costs() -> None:
    """A 1 MB stop string over a turn of 400 pushes: the held-back check tries only the ends of the
    text (trying every prefix of the stop string took about a second a push)."""
    import time

    stream = TextStream(letters, ("x" * 1_000_000,))
    t = time.perf_counter()
    for i in range(400):
        stream.push([i % 26])
    assert time.perf_counter() - t < 5.0
    assert stream.finish() == "" and len(stream.shown) == 400
