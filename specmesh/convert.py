"""Conversions between core dataclasses and their protobuf messages (specmesh.v1).

Only the services call these. Fields whose zero means something else than "off" (top_p,
repetition_penalty, seed) carry explicit presence (proto3 `optional`): unset is the default, an
explicit 0 reaches the core's validators and is refused there. Nothing is validated here.
"""

from __future__ import annotations

import json

import torch

from specmesh.grammar import GrammarSpec
from specmesh.sampling import SamplingParams
from specmesh.tree import DraftTree
from specmesh.v1 import common_pb2


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        repetition_penalty=float(msg.repetition_penalty) if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())),
        min_tokens=int(msg.min_tokens),
    )


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                    presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                    repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias),
                                    min_tokens=p.min_tokens)
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def structured_from_pb(msg: common_pb2.StructuredOutput) -> GrammarSpec:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured: set one of json_schema, json_object, regex, choice, lark")
    if kind == "json_object":
        return GrammarSpec(kind, "")
    if kind == "choice":
        return GrammarSpec(kind, json.dumps(list(msg.choice.choices)))
    return GrammarSpec(kind, getattr(msg, kind))


def structured_to_pb(spec: GrammarSpec) -> common_pb2.StructuredOutput:
    if spec.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if spec.kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=json.loads(spec.source)))
    return common_pb2.StructuredOutput(**{spec.kind: spec.source})


def tree_from_pb(msg: common_pb2.DraftTree) -> DraftTree:
    return DraftTree(
        tokens=list(msg.tokens),
        parents=list(msg.parents),
        q_nodes=[d.node for d in msg.q],
        q_ids=[list(d.ids) for d in msg.q],
        q_probs=[list(d.probs) for d in msg.q],
    )


def tree_to_pb(tree: DraftTree) -> common_pb2.DraftTree:
    return common_pb2.DraftTree(
        tokens=tree.tokens,
        parents=tree.parents,
        q=[common_pb2.SparseDist(node=n, ids=i, probs=p) for n, i, p in zip(tree.q_nodes, tree.q_ids, tree.q_probs)],
    )


FEATURE_DTYPE = torch.float16  # target features on the wire (drafter.proto)
FEATURE_DIM_KEY = "specmesh-feature-dim"  # the Draft stream's initial metadata: the width a drafter takes
GRAMMAR_KEY = "specmesh-grammar"  # ... and the grammar engine it prunes its trees with (absent: none)


def features_to_pb(features: torch.Tensor | None) -> bytes:
    """[rows, dim] -> fp16 little-endian row-major bytes (b"" for None)."""
    if features is None:
        return b""
    return features.detach().to("cpu", FEATURE_DTYPE).contiguous().numpy().astype("<f2", copy=False).tobytes()


def features_from_pb(data: bytes, rows: int, dim: int) -> torch.Tensor:
    """fp16 bytes -> [rows, dim] float32; ValueError naming the field when the size is wrong."""
    want = rows * dim * 2
    if len(data) != want:
        raise ValueError(f"features: expected {rows} x {dim} fp16 values ({want} bytes), got {len(data)} bytes")
    if rows == 0:
        return torch.empty(0, dim)
    t = torch.frombuffer(bytearray(data), dtype=FEATURE_DTYPE).view(rows, dim).float()
    if not torch.isfinite(t).all():
        raise ValueError("features: values must be finite")
    return t
