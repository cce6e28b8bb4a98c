"""A token's log-probability under the target, and its protobuf form (torch-free: the SDK and
the router use it too)."""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.v1 import verifier_pb2

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's chat limit)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target, with the target's most likely alternatives at
    its position. Raw: log_softmax of the target's logits, before temperature, top-k and top-p
    (what vLLM returns by default), so the value does not depend on how the token was chosen."""

    token: int
    logprob: float | None  # None: the first token of a context (nothing predicts it)
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def check_logprobs(logprobs: int | None, name: str = "logprobs") -> None:
    """None (no log-probabilities) or the alternatives per token, 0 to MAX_TOP_LOGPROBS."""
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{name}: must be in [0, {MAX_TOP_LOGPROBS}] alternatives per token, got {logprobs}")


def logprob_to_pb(lp: TokenLogprob) -> verifier_pb2.TokenLogprob:
    msg = verifier_pb2.TokenLogprob(token_id=lp.token, top_ids=[i for i, _ in lp.top],
                                    top_logprobs=[v for _, v in lp.top])
    if lp.logprob is not None:
        msg.logprob = lp.logprob
    return msg


def logprob_from_pb(msg: verifier_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob if msg.HasField("logprob") else None,
                        tuple(zip(msg.top_ids, msg.top_logprobs)))
