"""loadtest.drafter_acceptance on the bundled target: the target as its own drafter accepts
everything, the shipped drafter some but not all, over the same positions."""

from __future__ import annotations

import torch

from loadtest.drafter_acceptance import SHIPPED, acceptance
from loadtest.bench_drafters import pick_prompts


def test_acceptance_of_the_target_itself_and_of_the_shipped_drafter() -> None:
    from specmesh.loader import load_model
    from specmesh.runtime import load_target

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target, tok = load_target(None)
        res = acceptance(target, tok, {"self": target, "shipped": load_model(SHIPPED)},
                         pick_prompts("smollm2", 2), max_tokens=12)
    finally:
        torch.set_num_threads(threads)
    assert res["self"]["positions"] == res["shipped"]["positions"] > 12
    assert res["self"]["acceptance"] >= 0.95  # teacher-forced vs incremental numerics: near-ties only
    assert 0.0 < res["shipped"]["acceptance"] < res["self"]["acceptance"]
    assert res["shipped"]["std_err"] is not None
