"""Structured outputs: a grammar (JSON schema, any JSON object, regex, choice, Lark) as a
constraint on the target's distribution, on llguidance (Microsoft's grammar engine, the one
vLLM and SGLang also ship; no dependencies, a 3 MB wheel, where xgrammar pulls triton).

`Constraint` masks the rows of one step's forward the way `sampling.Penalizer` penalises them:
row 0 with the matcher in its committed state, row i + 1 after node i's path has been consumed
(a depth-first walk over the tree with consume / rollback). Tokens the grammar forbids get -inf,
so a forbidden node is never accepted (greedy: never the argmax; sampled: p = 0) and the bonus
token is drawn from a masked row: the output always matches the grammar, and greedy output is
token for token what target-only constrained decoding gives. Nodes under a forbidden one (or
under an EOS, which ends the turn) keep their rows unmasked: no output reaches them. Once the
grammar is complete only EOS is allowed.

`Guide` is the drafter's side: a copy of the turn's matcher that answers which tokens may follow
the turn's output so far plus a draft path, so that the drafter grows only allowed nodes and
draws them from its q renormalised over the allowed tokens (`drafters.base.TreeGuide`).
Verification stays what makes the output exact; the guide only raises acceptance.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from specmesh.text import common_prefix
from specmesh.tree import ROOT, children_of_parents

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str    # one of KINDS
    source: str  # the schema (JSON text), regex, Lark grammar; choice: a JSON list of strings; json_object: ""

    def grammar(self) -> str:
        """llguidance's grammar text; ValueError naming `structured` when the spec cannot be one."""
        import llguidance

        m = llguidance.LLMatcher
        try:
            if self.kind == "json_schema":
                return m.grammar_from_json_schema(json.loads(self.source))
            if self.kind == "json_object":
                return m.grammar_from_json_schema({"type": "object"})
            if self.kind == "regex":
                return m.grammar_from_regex(self.source)
            if self.kind == "choice":
                choices = json.loads(self.source)
                if not choices:
                    raise ValueError("at least one choice is needed")
                return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
            if self.kind == "lark":
                return m.grammar_from_lark(self.source)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured.{self.kind}: {e}") from e
        raise ValueError(f"structured: unknown kind {self.kind!r}, expected one of {KINDS}")


class Grammars:
    """One verifier's grammar engine: its tokenizer as llguidance sees it (built on first use,
    ~0.6 s for a 49k vocabulary) and a Constraint per structured turn."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self._ll = None

    def _tokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
            return self._ll

    def constraint(self, spec: GrammarSpec) -> Constraint:
        import llguidance

        grammar = spec.grammar()
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured.{spec.kind}: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, self.tokenizer.eos_token_id)

    def guide(self, spec: GrammarSpec) -> Guide:
        """A drafter's guide for a turn of this grammar."""
        return self.constraint(spec).guide()


def _allowed(matcher, vocab_size: int) -> torch.Tensor:
    """[V] bool: the tokens `matcher` allows next."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return torch.from_numpy(bits[:vocab_size].astype(bool))


class Constraint:
    """A turn's grammar over its output so far (an llguidance matcher), masking a step's rows."""

    def __init__(self, matcher, vocab_size: int, eos: int | None) -> None:
        self.matcher, self.vocab_size, self.eos = matcher, vocab_size, eos
        self.seconds = 0.0  # spent masking and advancing, over the turn (benchmarks report it)

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next."""
        return _allowed(self.matcher, self.vocab_size)

    def guide(self) -> Guide:
        """A drafter's guide from this turn's state on (its own matcher: drafting never moves this
        one)."""
        return Guide(self.matcher.deep_copy(), self.vocab_size, self.eos)

    def __call__(self, logits: torch.Tensor, parents: list[int], tokens: list[int]) -> torch.Tensor:
        """logits [N+1, V] with each reachable row's forbidden tokens at -inf."""
        t0 = time.perf_counter()
        kids = children_of_parents(parents)
        masks: dict[int, torch.Tensor] = {}
        m = self.matcher

        def visit(node: int) -> None:
            allowed = masks[node + 1] = self.allowed()
            for child in kids.get(node, ()):
                # not through EOS: it ends the turn, and the matcher does not count it as a token
                # that rollback(1) takes back
                if tokens[child] != self.eos and bool(allowed[tokens[child]]) and m.consume_token(tokens[child]):
                    visit(child)
                    m.rollback(1)

        visit(ROOT)
        out = logits.to(torch.float32).clone()
        rows = sorted(masks)
        out[rows] = out[rows].masked_fill(~torch.stack([masks[r] for r in rows]), float("-inf"))
        self.seconds += time.perf_counter() - t0
        return out

    def add(self, tokens: list[int]) -> None:
        """Tokens the turn emitted (each one allowed by a masked row)."""
        t0 = time.perf_counter()
        try:
            self._consume(tokens)
        finally:
            self.seconds += time.perf_counter() - t0

    def _consume(self, tokens: list[int]) -> None:
        for t in tokens:
            if self.matcher.is_stopped():
                return  # complete: what follows is the EOS that ends the turn
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"grammar: emitted token {t} the matcher refused ({self.matcher.get_error()})")


class Guide:
    """Which tokens may follow a draft node: the grammar's state after the turn's output up to the
    node (`seq`: the output the turn has, then the node's path). Its matcher follows the sequence
    asked about by rolling back to the common prefix with the last one and consuming the rest,
    so the nodes of a level, which share their ancestors, cost a few tokens each."""

    def __init__(self, matcher, vocab_size: int, eos: int | None) -> None:
        self.matcher, self.vocab_size, self.eos = matcher, vocab_size, eos
        self._fed: list[int] = []  # the tokens the matcher has consumed, from the turn's start
        self.seconds = 0.0  # spent computing masks (benchmarks report it)

    def allowed(self, seq: list[int]) -> torch.Tensor | None:
        """[V] bool: the tokens that may follow the turn's output `seq`; None when `seq` is not an
        output the grammar accepts (the drafter's context ran past the verifier's, or the guide
        is for another turn): then nothing is pruned."""
        t0 = time.perf_counter()
        try:
            if self.eos is not None and self.eos in seq:  # nothing follows the end of the turn
                return torch.zeros(self.vocab_size, dtype=torch.bool)
            fed, m = self._fed, self.matcher
            same = common_prefix(fed, seq)
            if len(fed) > same:
                m.rollback(len(fed) - same)
                del fed[same:]
            if len(seq) > same:
                took = m.try_consume_tokens(seq[same:])
                fed.extend(seq[same:same + took])
                if same + took < len(seq):
                    return None
            return _allowed(m, self.vocab_size)
        finally:
            self.seconds += time.perf_counter() - t0
