"""Placement policies: small literal cases (pure functions, no Redis)."""

from __future__ import annotations

import pytest

from router.policies import (
    POLICIES,
    Load,
    NoVerifierError,
    Overload,
    PolicyName,
    RequestMeta,
    get_policy,
)
from specmesh.registry import Binding, Endpoint, Role

V, D = Role.VERIFIER, Role.DRAFTER
A, B, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
DA, DB = "10.0.1.1:1", "10.0.1.2:1"
THREE = [Endpoint(A, V), Endpoint(B, V), Endpoint(C, V)]
STICKY = get_policy("sticky-least-tokens")


def loads(**q: tuple[int, int]) -> dict[str, Load]:
    """loads(A=(turns, tokens)) with the letters standing for addresses."""
    names = {"A": A, "B": B, "C": C, "DA": DA, "DB": DB}
    return {names[k]: Load(*v) for k, v in q.items()}


@pytest.mark.parametrize("name, current, load, context, expected", [
    # new session: least queued context tokens
    ("new -> least tokens", None, loads(A=(1, 9000), B=(3, 100), C=(1, 5000)), 10, B),
    # tokens, not requests, decide: B has more turns but fewer tokens
    ("tokens beat requests", None, loads(A=(1, 60000), B=(5, 2000), C=(1, 3000)), 10, B),
    # sticky: bound verifier busier, but under the absolute threshold
    ("sticky under absolute", Binding(A), loads(A=(4, 30000), B=(0, 0), C=(0, 0)), 100, A),
    # sticky: above absolute but not ratio x (least other + own context)
    ("sticky under relative", Binding(A), loads(A=(4, 40000), B=(2, 15000), C=(3, 18000)), 6000, A),
    # overloaded on both thresholds -> the least loaded other verifier
    ("overloaded moves", Binding(A), loads(A=(8, 90000), B=(1, 1000), C=(2, 8000)), 4000, B),
    # a long own context makes moving not worth it (re-prefill counts)
    ("long context stays", Binding(A), loads(A=(8, 90000), B=(1, 1000)), 60000, A),
    # bound verifier gone -> least loaded live one
    ("gone rebinds", Binding("10.9.9.9:1"), loads(A=(0, 500), B=(0, 100), C=(0, 900)), 10, B),
])
def test_sticky_least_tokens(name, current, load, context, expected):
    meta = RequestMeta("s1", context_tokens=context, overload=Overload(tokens=32768, ratio=2.0))
    got = STICKY(meta, THREE, load, current)
    assert got.verifier == expected
    if current is not None:
        assert got.epoch == (current.epoch if expected == current.verifier else current.epoch + 1)


def test_sticky_keeps_binding_object_and_epoch():
    current = Binding(A, "", epoch=7)
    assert STICKY(RequestMeta("s"), THREE, {}, current) is current


def test_capacity_full_moves_only_when_another_has_room():
    eps = [Endpoint(A, V, capacity=2), Endpoint(B, V, capacity=2)]
    assert STICKY(RequestMeta("s"), eps, loads(A=(2, 10), B=(0, 0)), Binding(A)).verifier == B
    assert STICKY(RequestMeta("s"), eps, loads(A=(2, 10), B=(2, 10)), Binding(A)).verifier == A


def test_idle_verifiers_share_new_sessions():
    got = {STICKY(RequestMeta(f"s{i}"), THREE, {}, None).verifier for i in range(30)}
    assert got == {A, B, C}


def test_held_kv_tokens_break_ties():
    eps = [Endpoint(A, V, kv_tokens=90000), Endpoint(B, V, kv_tokens=100)]
    assert STICKY(RequestMeta("s"), eps, {}, None).verifier == B


@pytest.mark.parametrize("policy", list(PolicyName))
def test_excluded_and_other_models_are_never_chosen(policy):
    eps = [Endpoint(A, V, model="m1"), Endpoint(B, V, model="m2"), Endpoint(C, V, model="m1")]
    meta = RequestMeta("s", model="m1", exclude=frozenset({A}))
    for seq in range(4):
        assert POLICIES[policy](RequestMeta(meta.session_id, model="m1", seq=seq, exclude=meta.exclude),
                                eps, {}, Binding(A)).verifier == C


@pytest.mark.parametrize("policy", list(PolicyName))
def test_no_verifier_raises(policy):
    with pytest.raises(NoVerifierError):
        POLICIES[policy](RequestMeta("s"), [Endpoint(DA, D)], {}, None)
    with pytest.raises(NoVerifierError):
        POLICIES[policy](RequestMeta("s", exclude=frozenset({A})), [Endpoint(A, V)], {}, None)


def test_least_requests_ignores_affinity():
    got = get_policy("least-requests")(RequestMeta("s"), THREE, loads(A=(3, 10), B=(1, 90000), C=(2, 0)), Binding(A))
    assert got == Binding(B, "", 2)


def test_round_robin_cycles_in_address_order():
    rr = get_policy("round-robin")
    shuffled = [THREE[2], THREE[0], THREE[1]]
    assert [rr(RequestMeta("s", seq=i), shuffled, {}, None).verifier for i in range(4)] == [A, B, C, A]


@pytest.mark.parametrize("current, load, expected", [
    (None, loads(DA=(3, 0), DB=(1, 0)), DB),                    # new: least loaded
    (Binding(A, DA), loads(DA=(9, 0), DB=(0, 0)), DA),          # sticky while alive
    (Binding(A, "10.9.9.9:2"), loads(DA=(2, 0), DB=(1, 0)), DB),  # gone: least loaded
])
def test_drafters_least_loaded_and_sticky(current, load, expected):
    eps = THREE + [Endpoint(DA, D), Endpoint(DB, D)]
    assert STICKY(RequestMeta("s"), eps, load, current).drafter == expected


def test_no_drafter_registered_means_verifier_default():
    assert STICKY(RequestMeta("s"), THREE, {}, None).drafter == ""


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="least-requests"):
        get_policy("random")
