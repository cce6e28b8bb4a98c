"""Tests for specmesh.tree: validation of untrusted draft trees and the derived structure."""

from __future__ import annotations

import pytest
import torch

from specmesh.tree import (
    ROOT,
    DraftTree,
    InvalidTreeError,
    children_of,
    depths,
    path_to,
    tree_attention_mask,
    validate_tree,
)

VOCAB = 10
MAX_NODES = 8

#        root
#       /    \
#     0:5    1:6
#    /   \
#  2:7   3:8
#   |
#  4:9
LITERAL = DraftTree(
    tokens=[5, 6, 7, 8, 9],
    parents=[-1, -1, 0, 0, 2],
    q_nodes=[ROOT, 0, 2],
    q_ids=[[5, 6], [7, 8, 1], [9]],
    q_probs=[[0.5, 0.5], [0.25, 0.25, 0.5], [1.0]],
)


def _tree(**changes) -> DraftTree:
    fields = dict(
        tokens=LITERAL.tokens,
        parents=LITERAL.parents,
        q_nodes=LITERAL.q_nodes,
        q_ids=LITERAL.q_ids,
        q_probs=LITERAL.q_probs,
    )
    fields.update(changes)
    return DraftTree(**fields)


@pytest.mark.parametrize(
    "tree, kwargs, field",
    [
        (_tree(tokens=[5, 6, 7, 8, VOCAB]), {}, "tokens[4]"),
        (_tree(tokens=[5, -1, 7, 8, 9]), {}, "tokens[1]"),
        (_tree(parents=[-1, -1, 2, 0, 2]), {}, "parents[2]"),  # parent after child
        (_tree(parents=[-1, -1, 0, 3, 2]), {}, "parents[3]"),  # own parent
        (_tree(parents=[-1, -2, 0, 0, 2]), {}, "parents[1]"),  # below ROOT
        (DraftTree.chain([1] * (MAX_NODES + 1)), {}, "tokens"),  # too many nodes
        (_tree(), {"max_depth": 2}, "parents"),  # depth 3 over limit
        (_tree(parents=[-1, -1, 0, 0]), {}, "parents"),  # length mismatch
        (_tree(q_ids=LITERAL.q_ids[:2]), {}, "q_ids/q_probs"),
        (_tree(q_probs=[[0.5, 0.4], [0.25, 0.25, 0.5], [1.0]]), {}, "q_probs[0]"),
        (_tree(q_probs=[[0.5, 0.5], [0.25, 0.25, 0.5], [float("nan")]]), {}, "q_probs[2]"),
        (_tree(q_probs=[[1.5, -0.5], [0.25, 0.25, 0.5], [1.0]]), {}, "q_probs[0]"),
        (_tree(q_probs=[[0.5, 0.5], [0.5, 0.5], [1.0]]), {}, "q_probs[1]"),  # len != ids
        (_tree(q_ids=[[5, 5], [7, 8, 1], [9]]), {}, "q_ids[0]"),  # duplicate ids
        (_tree(q_ids=[[5, 6], [7, 8, VOCAB], [9]]), {}, "q_ids[1]"),
        (_tree(q_nodes=[ROOT, 0, 5]), {}, "q_nodes[2]"),
        (_tree(q_nodes=[ROOT, 0, 0]), {}, "q_nodes[2]"),  # listed twice
        (_tree(q_nodes=[ROOT, 0], q_ids=LITERAL.q_ids[:2], q_probs=LITERAL.q_probs[:2]),
         {"need_q": True}, "q_nodes"),  # node 2 has a child but no q
        (_tree(q_ids=[[5, 6], [7, 1, 8], [9]], q_probs=[[0.5, 0.5], [0.5, 0.5, 0.0], [1.0]]),
         {"need_q": True}, "tokens[3]"),  # child 8 has zero q probability
        (_tree(tokens=[5, 6, 7, 2, 9]), {"need_q": True}, "tokens[3]"),  # child not in q at all
    ],
)
def test_validate_tree_rejects_bad_tree(tree: DraftTree, kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidTreeError) as info:
        validate_tree(tree, vocab_size=VOCAB, max_nodes=MAX_NODES, **kwargs)
    assert str(info.value).startswith(field), str(info.value)


@pytest.mark.parametrize(
    "tree, kwargs",
    [
        (LITERAL, {}),
        (LITERAL, {"need_q": True, "max_depth": 3}),
        (DraftTree.empty(), {"need_q": True, "max_depth": 1}),
        (DraftTree.chain([0, VOCAB - 1, 3]), {}),  # greedy: q not needed
        (DraftTree.chain([1] * MAX_NODES), {}),  # exactly at the node limit
        # Duplicate siblings are legal: children are i.i.d. draws from q.
        (DraftTree([4, 4], [-1, -1], [ROOT], [[4, 2]], [[0.9, 0.1]]), {"need_q": True}),
    ],
)
def test_validate_tree_accepts_good_tree(tree: DraftTree, kwargs: dict) -> None:
    validate_tree(tree, vocab_size=VOCAB, max_nodes=MAX_NODES, **kwargs)


def test_invalid_tree_error_is_value_error() -> None:
    assert issubclass(InvalidTreeError, ValueError)


def test_structure_of_literal_tree() -> None:
    assert depths(LITERAL.parents) == [1, 1, 2, 2, 3]
    assert children_of(LITERAL) == {ROOT: [0, 1], 0: [2, 3], 1: [], 2: [4], 3: [], 4: []}
    assert path_to(LITERAL.parents, 4) == [0, 2, 4]
    assert path_to(LITERAL.parents, 3) == [0, 3]
    assert path_to(LITERAL.parents, 1) == [1]
    assert path_to(LITERAL.parents, ROOT) == []
    assert len(LITERAL) == 5


def test_tree_attention_mask_literal() -> None:
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [0, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [1, 0, 0, 1, 0],
            [1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    mask = tree_attention_mask(LITERAL.parents)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


def test_chain_mask_is_causal_and_empty_tree_is_empty() -> None:
    chain = DraftTree.chain([3, 1, 4, 1])
    assert chain.parents == [-1, 0, 1, 2]
    assert depths(chain.parents) == [1, 2, 3, 4]
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(tree_attention_mask(chain.parents), causal)
    assert tree_attention_mask([]).shape == (0, 0)
    assert children_of(DraftTree.empty()) == {ROOT: []}
