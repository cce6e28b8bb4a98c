"""What a load test sends and when: units of work (a one-shot chat prompt, or a multi-round session
whose context grows turn by turn), their A/B arms, and arrival times.

- Every unit starts with the same shared system prompt (prefix reuse across sessions).
- A fraction of sessions is long-context: a long document precedes their first question.
- A/B: every unit is served once per arm, arms interleaved and alternating which goes first
  (unit 0: A then B, unit 1: B then A, ...), so both see the same prompts and the same load.
- Arrivals: closed loop (rate = inf: all queued at once, `max_concurrency` in flight) or open
  loop with gamma-distributed gaps (burstiness 1 = Poisson; < 1 burstier; > 1 more regular),
  as vLLM's benchmark does.
Deterministic for a seed; pure (no I/O, no clock).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

SPEC_ON, SPEC_OFF = "spec", "nospec"

SYSTEM_PROMPT = ("You are a concise assistant for a team that runs language models in production. "
                 "Answer in plain sentences, quote the user's material when it helps, and keep lists short.")

QUESTIONS = (
    "Explain speculative decoding in two sentences.",
    "What is a KV cache and why does it grow with the context?",
    "List five colors of the rainbow, one per line.",
    "Write a haiku about the sea.",
    "Count from one to twenty in words, separated by commas.",
    "What is the capital of France, and what river runs through it?",
    "Give three tips for writing clear commit messages.",
    "Describe a tree data structure to a ten year old.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a short Python function that reverses a string.",
    "What are the planets of the solar system, in order from the sun?",
    "Summarize the plot of Little Red Riding Hood in three sentences.",
    "Why is the sky blue? Answer briefly.",
    "Name the days of the week, starting on Monday.",
    "What does an HTTP 404 status code mean?",
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
)

FOLLOW_UPS = (
    "Can you say that again more briefly?",
    "Give one more example.",
    "Now repeat your previous answer, word for word.",
    "What is the most important point of what you said?",
    "Rewrite that as a numbered list.",
    "Thanks. Explain the first point in more detail.",
)

DOCUMENT_SENTENCES = (
    "The verifier keeps the key and value tensors of every token of a session in its cache.",
    "A drafter proposes a tree of candidate tokens, and the verifier checks the whole tree in one pass.",
    "Accepted tokens are appended to the cache, and rejected branches are dropped at once.",
    "The router keeps each session on the verifier that holds its cache, so long prompts are not recomputed.",
    "When a verifier fails, the router rebuilds the session elsewhere from the token history in Redis.",
    "Tensor parallelism splits every weight matrix across ranks and sums the partial results.",
    "Sampling stays lossless because rejected draft tokens are replaced by draws from the residual distribution.",
    "Under heavy load the speculation budget shrinks, because verification stops being free.",
)

LONG_CONTEXT_QUESTIONS = (
    "Quote the first sentence of the document above.",
    "What does the document say about the router? Quote it.",
    "List the topics the document covers.",
    "Which sentence of the document mentions tensor parallelism? Repeat it.",
)


@dataclass(frozen=True)
class Unit:
    """One session (rounds >= 1) of user messages; the assistant's replies come from the server."""
    index: int
    system: str
    user_turns: tuple[str, ...]
    long_context: bool = False

    @property
    def rounds(self) -> int:
        return len(self.user_turns)


@dataclass(frozen=True)
class WorkloadSpec:
    units: int = 8                   # prompts (rounds = 1) or sessions per arm
    rounds: int = 1                  # turns per session; 1 = one-shot requests
    long_fraction: float = 0.0       # share of sessions with a long document first
    long_words: int = 600            # approximate length of that document in words
    system_prompt: str = SYSTEM_PROMPT
    seed: int = 0

    def validate(self) -> None:
        if self.units < 1 or self.rounds < 1:
            raise ValueError(f"units and rounds: must be >= 1, got {self.units}, {self.rounds}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction: must be in [0, 1], got {self.long_fraction}")
        if self.long_words < 1:
            raise ValueError(f"long_words: must be >= 1, got {self.long_words}")


def long_document(words: int, rng: random.Random) -> str:
    """About `words` words of sentences from DOCUMENT_SENTENCES, shuffled."""
    out: list[str] = []
    n = 0
    while n < words:
        s = rng.choice(DOCUMENT_SENTENCES)
        out.append(s)
        n += len(s.split())
    return " ".join(out)


def build_units(spec: WorkloadSpec) -> list[Unit]:
    spec.validate()
    rng = random.Random(spec.seed)
    n_long = round(spec.units * spec.long_fraction)
    long_ids = set(rng.sample(range(spec.units), n_long))
    units = []
    for i in range(spec.units):
        if i in long_ids:
            doc = long_document(spec.long_words, rng)
            first = f"Here is a document:\n\n{doc}\n\n{rng.choice(LONG_CONTEXT_QUESTIONS)}"
        else:
            first = QUESTIONS[(i + spec.seed) % len(QUESTIONS)]
        rest = tuple(rng.choice(FOLLOW_UPS) for _ in range(spec.rounds - 1))
        units.append(Unit(i, spec.system_prompt, (first, *rest), i in long_ids))
    return units


def messages_for(unit: Unit, replies: Sequence[str]) -> list[dict]:
    """The chat of the next turn: system, then user/assistant alternating, ending with a user turn."""
    turn = len(replies)
    assert turn < unit.rounds, "no user turn left"
    msgs = [{"role": "system", "content": unit.system}]
    for user, reply in zip(unit.user_turns, replies):
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return msgs + [{"role": "user", "content": unit.user_turns[turn]}]


def ab_jobs(units: Sequence[Unit], arms: Sequence[str]) -> list[tuple[Unit, str]]:
    """Every unit once per arm, interleaved; with two arms the first alternates unit by unit."""
    jobs = []
    for u in units:
        order = list(arms) if u.index % 2 == 0 else list(reversed(arms))
        jobs += [(u, a) for a in order]
    return jobs


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of `n` jobs: all 0 for rate = inf (closed loop), else
    the first at 0 and gamma(shape=burstiness, scale=1/(rate*burstiness)) gaps (mean 1/rate)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness: must be > 0, got {rate}, {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out
