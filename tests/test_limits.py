"""Limits have one home (`specmesh.limits`): the HTTP API, the engine and the drafter service hold
a request to the same ones, and token ids are checked one way everywhere."""

from __future__ import annotations

import pytest

from router import http_api
from router.errors import RouterError
from specmesh.engine import SpecConfig
from specmesh.limits import MAX_DEPTH, MAX_TREE_NODES, check_ids


@pytest.mark.parametrize("name, top", [("budget", MAX_TREE_NODES), ("depth", MAX_DEPTH)])
def test_the_http_api_and_the_core_hold_speculation_to_the_same_limits(name, top):
    assert getattr(http_api._speculation({"speculation": {name: top}}), name) == top
    with pytest.raises(RouterError) as e:
        http_api._speculation({"speculation": {name: top + 1}})
    assert e.value.code == f"speculation.{name}" and f"[0, {top}]" in e.value.message
    SpecConfig(MAX_TREE_NODES, MAX_DEPTH).validate()
    field = {"budget": "tree_budget", "depth": "depth"}[name]
    shape = {"budget": MAX_TREE_NODES, "depth": MAX_DEPTH, name: top + 1}
    with pytest.raises(ValueError, match=f"^{field}: must be in \\[1, {top}\\]"):
        SpecConfig(shape["budget"], shape["depth"]).validate()


def test_the_drafter_service_holds_trees_to_the_same_limits():
    from drafter_service.servicer import RequestError, _check_shape

    _check_shape(MAX_TREE_NODES, MAX_DEPTH)
    for budget, depth, field in ((MAX_TREE_NODES + 1, 4, "budget"), (8, MAX_DEPTH + 1, "depth")):
        with pytest.raises(RequestError, match=f"^{field}:"):
            _check_shape(budget, depth)


def test_check_ids_names_the_field_and_the_bound():
    check_ids([0, 9], 10, "prompt")
    with pytest.raises(ValueError, match=r"^prompt: token id 10 outside vocabulary \[0, 10\)"):
        check_ids([3, 10], 10, "prompt")
    with pytest.raises(ValueError, match=r"^history: token id -1 outside vocabulary \[0, 2\*\*31\)"):
        check_ids([-1], None, "history")
    check_ids([10**6], None, "context")
