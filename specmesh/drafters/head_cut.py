"""A drafter's LM head cut to the tokens it is likely to propose, plus its session's context.

On a CPU a drafter level reads every weight once, and a large vocabulary's head is a large part of
them: the Qwen2.5-Coder 0.5B's 151,936 x 896 head is about a quarter of its bytes at 4 bits. Like
FR-Spec (Zhao et al., 2025) and SGLang's `--speculative-token-map`, the head keeps only the rows
of frequent tokens: here the lowest `size` ids, because byte-level BPE vocabularies number their
tokens in merge order, the most frequent pairs of the tokenizer's training corpus first (no corpus
to count from is needed, and none can be downloaded), and the tokenizer's added tokens (end of
turn, end of text). What a cut alone loses is the rare token that the prompt itself brings (a
name, a term of the task): every token of the session's context is scored beside the head from
its own row of the file (`HeadCut.rows`, made once per session and token), so the drafter can
propose it again.

Tokens outside both get probability 0 from the drafter. That changes only how often proposals are
accepted, never the output: the verifier's acceptance rule takes the drafter's probabilities as
they are (a token the drafter cannot propose is covered by the residual distribution).
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

# rows kept by default where the vocabulary is larger (`loader.load_drafter_weights`): the most
# that cost no acceptance on held-out chat and code prompts with the Qwen2.5-Coder pair (README)
DEFAULT_SIZE = 81920


@dataclass
class HeadCut:
    """What a cut head leaves out, for the sessions to score their own context beside it."""
    in_head: torch.Tensor  # [vocab] bool: the token has a row in the cut head
    rows: torch.nn.Module  # ids [N] -> [N, hidden] fp32: rows of the whole head, as the cut head holds its own


class ContextVocab:
    """One session's tokens beyond a cut head: the ids of its context that the head lacks and their
    rows, grown as tokens are committed (`Segment.extra_vocab`)."""

    def __init__(self, cut: HeadCut) -> None:
        self.cut = cut
        self._seen: set[int] = set()
        self._ids: list[int] = []
        self._rows: list[torch.Tensor] = []
        self._value: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, tokens: list[int]) -> None:
        new = sorted({t for t in tokens if t not in self._seen and 0 <= t < len(self.cut.in_head)})
        self._seen.update(new)
        new = [t for t in new if not self.cut.in_head[t]]
        if new:
            self._ids.extend(new)
            self._rows.append(self.cut.rows(torch.tensor(new)).float())
            self._value = None

    @property
    def value(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._ids:
            return None
        if self._value is None:
            self._rows = [torch.cat(self._rows)]
            self._value = (torch.tensor(self._ids), self._rows[0])
        return self._value


def kept_ids(vocab: int, size: int, added: list[int]) -> torch.Tensor:
    """The head rows kept, in id order: ids below `size`, and the tokenizer's added tokens."""
    keep = set(range(min(size, vocab))) | {t for t in added if 0 <= t < vocab}
    return torch.tensor(sorted(keep))


def cut_gguf_head(model, out, size: int, added: list[int]):
    """Cut `model`'s head (a `gguf` drafter's, 4-bit codes on the integer kernel) to `kept_ids`,
    rebuilt from `out`, the GGUF tensor of its rows (gguf's ReaderTensor: `loader.head_tensor`), and
    requantized to 4 bits as the whole head was (`loader.requantize_to_4bit`); sets
    `model.vocab_map` and `model.head_cut` and names the cut in the model card. A vocabulary no
    larger than `size` is left whole."""
    from gguf.quants import dequantize

    from specmesh.quant import int4_linear

    vocab, hidden = int(out.shape[1]), int(out.shape[0])
    if vocab != model.config.vocab_size or size >= vocab:
        return model
    keep = kept_ids(vocab, size, added)
    w = torch.from_numpy(dequantize(out.data[keep.numpy()], out.tensor_type).reshape(len(keep), hidden).copy())
    model.lm_head = int4_linear(w.float(), None)
    model.vocab_map = keep
    model.weight_format.head = f"{len(keep)} of {vocab} tokens, and each session's context"
    return attach(model, out)


def attach(model, out):
    """Set `model.head_cut` for a model whose head was cut (`model.vocab_map`) from `out`, the GGUF
    tensor of its rows."""
    from specmesh.quant import GGUFEmbedding

    vocab = int(out.shape[1])
    in_head = torch.zeros(vocab, dtype=torch.bool)
    in_head[model.vocab_map] = True
    model.head_cut = HeadCut(in_head, _Int4Rows(GGUFEmbedding(out.data, out.tensor_type, dim=int(out.shape[0]))))
    return model


class _Int4Rows(torch.nn.Module):
    """Rows of the whole head as the cut head holds its own: the file's rows requantized to 4 bits
    (`quant.int4_weights`), so a context token is scored on the same footing as the head's."""

    def __init__(self, rows: torch.nn.Module) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from specmesh.quant import int4_weights

        return int4_weights(self.rows(ids))  # [N, hidden]

