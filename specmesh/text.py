"""Stop rules and visible text of a turn, from token ids alone (pure; `decode` is passed in).

One set of rules, and one type saying what they apply (`StopConditions`), for the engine, the
verifier, the router and the CLI: a turn ends after its max tokens or at a stop; a stop fires at
the first stop id, or at the first token whose trailing window of `STOP_WINDOW` tokens decodes to
text containing a stop string; the shown text is cut before a stop string (as OpenAI-style APIs
return it), and while streaming an incomplete UTF-8 character and any tail that could still grow
into a stop string are held back. The router decodes a turn's tokens itself (TextStream) rather than
forwarding the verifier's text deltas, so that a turn that moved to another verifier mid-stream
still reads as one text, and a stop that straddles the move is still seen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

STOP_WINDOW = 64  # tokens decoded when looking for a stop string that ends at the newest token

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class StopConditions:
    """When a turn ends: after `max_new_tokens` new tokens, or at a stop (`first_stop`)."""
    max_new_tokens: int = 128
    stop_ids: frozenset[int] = frozenset()  # EOS included by the caller (unless ignore_eos)
    stop_strings: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop: stop strings must be non-empty")


def eos_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's end-of-sequence id as the stop ids every turn has (unless it ignores EOS)."""
    return frozenset([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else frozenset()


def first_stop(tokens: Sequence[int], start: int, ids: frozenset[int], strings: tuple[str, ...],
               decode: Decode | None) -> int | None:
    """Length to cut `tokens` (the turn's new tokens) to if a stop fires at index >= `start`."""
    for i in range(start, len(tokens)):
        if tokens[i] in ids:
            return i + 1
    if strings and decode is not None:
        for i in range(start, len(tokens)):
            text = decode(list(tokens[max(0, i + 1 - STOP_WINDOW): i + 1]))
            if any(s in text for s in strings):
                return i + 1
    return None


def visible(text: str, strings: tuple[str, ...], final: bool) -> str:
    """The part of `text` safe to show (see the module docstring); `final`: nothing more will come."""
    cut = min((text.find(s) for s in strings if s in text), default=-1)
    if cut >= 0:
        return text[:cut]
    if final:
        return text
    text = text.rstrip("\ufffd")
    return text[: len(text) - max((_held(text, s) for s in strings), default=0)]


def _held(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `stop` (it may still grow
    into the stop string). Only ends no longer than the text are tried: the cost follows the text,
    not the stop string (a megabyte stop string took seconds a token when every prefix was tried)."""
    if len(stop) < 2:
        return 0
    j = max(0, len(text) - (len(stop) - 1))  # the longest candidate end starts here ...
    while (j := text.find(stop[0], j)) >= 0:  # ... and every candidate with the stop's first character
        if stop.startswith(text[j:]):
            return len(text) - j
        j += 1
    return 0


@dataclass
class TextStream:
    """Text deltas of a growing list of tokens, decoded incrementally: each push decodes only the
    new tokens with the ones pushed just before them as context (`decode(tokens[ctx:])` minus
    `decode(tokens[ctx:read])`: the context settles a tokenizer's leading-space rules), so a push
    costs the size of the push, not of everything before it. A tail that decodes to an incomplete UTF-8 character
    is held until the character completes (or `finish`). Should the windowed decode ever disagree
    with what it decoded before, the stream re-decodes the whole text once."""
    decode: Decode
    strings: tuple[str, ...] = ()
    shown: str = ""
    tokens: list[int] = field(default_factory=list)
    _text: str = ""  # decode(tokens[:_read]), settled
    _ctx: int = 0    # tokens[_ctx:_read]: the context the next decode starts from
    _read: int = 0

    def push(self, ids: Sequence[int]) -> str:
        self.tokens.extend(ids)
        return self._delta(self._decoded(final=False), final=False)

    def finish(self) -> str:
        return self._delta(self._decoded(final=True), final=True)

    def _decoded(self, final: bool) -> str:
        """The text of all tokens: settled + pending (pending only in full when `final`, else up
        to an incomplete character)."""
        if self._read == len(self.tokens):
            return self._text
        ctx = self.decode(self.tokens[self._ctx:self._read])
        new = self.decode(self.tokens[self._ctx:])
        if not new.startswith(ctx):  # the context decodes otherwise now: start over, whole
            self._text, self._ctx, self._read = "", 0, 0
            ctx, new = "", self.decode(self.tokens)
        tail = new[len(ctx):]
        if tail.endswith("\ufffd") and not final:
            return self._text + tail.rstrip("\ufffd")
        self._text += tail
        self._ctx, self._read = self._read, len(self.tokens)
        return self._text

    def _delta(self, decoded: str, final: bool) -> str:
        text = visible(decoded, self.strings, final)
        if len(text) <= len(self.shown):
            return ""
        delta, self.shown = text[len(self.shown):], text
        return delta


class TokenPieces:
    """Each token's own text and bytes, as OpenAI's logprobs show them (`token`, `bytes`).

    Byte-level BPE tokenizers (GPT-2 style: SmolLM2, Qwen, Llama 3) spell a token's bytes as
    printable characters; those map back to the exact bytes, so a token holding half of a UTF-8
    character gets its real bytes, and its `token` reads "bytes:\\xe2\\x80" as in OpenAI's API.
    Other tokenizers: the token decoded alone, as UTF-8."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._bytes_of = None
        if type(decoder).__name__ == "ByteLevel":
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._bytes_of = {c: b for b, c in bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._piece(token_id)
        return hit

    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        spelled = self.tokenizer.convert_ids_to_tokens(token_id)
        table = self._bytes_of
        if table is not None and spelled and all(c in table for c in spelled):
            raw = bytes(table[c] for c in spelled)
        else:
            raw = self.tokenizer.decode([token_id]).encode("utf-8")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
