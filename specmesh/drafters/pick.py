"""The rule that picks the next step's tree from a predraft once the bonus token is known, shared
by the drafter (`specmesh.drafters.predraft`) and a verifier that takes a pushed predraft
(`verifier_service.drafter_link`), so that both pick the same tree."""

from __future__ import annotations

from specmesh.sampling import SamplingParams
from specmesh.tree import ROOT, DraftTree, children_of, depths, subtree, trim


def pick_predrafted(predraft: DraftTree, bonus: int, budget: int, depth: int, min_depth: int = 1) -> DraftTree | None:
    """The tree under the first root child of `predraft` with token `bonus` that has children,
    trimmed to the requested shape; None when there is none, or when it is less than `min_depth`
    deep. `min_depth` > 1 is for greedy decoding only: under sampling, choosing a subtree by its
    depth would choose it by the draws below it (their scores shape the tree), and verification
    needs every node's children to be plain draws from its q."""
    kids = children_of(predraft)
    for c in kids[ROOT]:
        if predraft.tokens[c] == bonus and kids[c]:
            tree = trim(subtree(predraft, c), budget, depth)
            return tree if max(depths(tree.parents), default=0) >= min_depth else None
    return None


def useful_depth(depth: int, params: SamplingParams) -> int:
    """The shallowest predrafted tree worth sending instead of a fresh draft: half the requested
    depth for greedy decoding (a one-token tree answered at once loses to a full tree answered a
    draft later whenever drafting costs less than verifying: the regime pipelining is for);
    any depth under sampling (see `pick_predrafted`)."""
    return (depth + 1) // 2 if params.greedy else 1


def next_tree_from(predraft: DraftTree, bonus: int, budget: int, depth: int, params: SamplingParams) -> DraftTree | None:
    """The tree for the next step that `predraft` gives once `bonus` is known, or None: the one
    rule the drafter and a verifier taking a pushed predraft both apply, so they pick the same tree.
    `depth`: the depth planned for that tree (within the caps; a pushed predraft says it)."""
    return pick_predrafted(predraft, bonus, budget, depth, useful_depth(depth, params))
