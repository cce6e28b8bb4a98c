"""The verifier's pipelining setting (verifier_service.config): `auto` predrafts unless the drafter
shares this machine's cores with a verifier that already takes them all; on and off are kept as
given; `--no-pipelining` is `off`."""

from __future__ import annotations

import pytest

from verifier_service import config
from verifier_service.config import VerifierConfig, on_this_machine


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(config, "cpu_count", lambda: 2)


def test_auto_takes_turns_only_with_a_local_drafter_on_cores_the_verifier_fills(two_cores):
    fills, half = VerifierConfig(threads=2), VerifierConfig(threads=1)
    assert not fills.pipelines("127.0.0.1:5000") and not fills.pipelines("localhost:5000")
    assert not fills.pipelines("[::1]:5000")
    assert fills.pipelines("10.0.0.7:5000") and fills.pipelines("drafter.specmesh.svc:50061")
    assert half.pipelines("127.0.0.1:5000")  # a core is left for the drafter
    assert not VerifierConfig(threads=1, tp=2).pipelines("127.0.0.1:5000")  # two local ranks fill both
    assert VerifierConfig(threads=1, tp=2, tp_local_ranks=1).pipelines("127.0.0.1:5000")


def test_on_and_off_are_kept_as_given(two_cores):
    assert VerifierConfig(threads=2, pipelining="on").pipelines("127.0.0.1:5000")
    assert not VerifierConfig(threads=1, pipelining="off").pipelines("10.0.0.7:5000")


def test_a_drafter_is_told_when_it_shares_the_verifiers_cores(two_cores):
    """What `auto` decides by is sent to the drafter with each session (OpenSession.shares_cores),
    whatever the setting: with pipelining on, its planner then prices work beside a verification
    as taking its own time after it."""
    on = VerifierConfig(threads=2, pipelining="on")
    assert on.shares_cores("127.0.0.1:5000") and not on.shares_cores("10.0.0.7:5000")
    assert not VerifierConfig(threads=1, pipelining="on").shares_cores("127.0.0.1:5000")


def test_flags():
    assert VerifierConfig.from_args([]).pipelining == "auto"
    assert VerifierConfig.from_args(["--pipelining", "on"]).pipelining == "on"
    assert VerifierConfig.from_args(["--no-pipelining"]).pipelining == "off"
    with pytest.raises(SystemExit):
        VerifierConfig.from_args(["--pipelining", "sometimes"])


def test_loopback_addresses():
    assert on_this_machine("127.0.0.2:1") and on_this_machine("LOCALHOST:1")
    assert not on_this_machine("x127.example.com:1") and not on_this_machine("192.168.0.1:1")


def test_drafter_addr_and_its_deprecated_old_name(capsys):
    assert VerifierConfig.from_args(["--drafter-addr", "127.0.0.1:5"]).drafter == "127.0.0.1:5"
    assert capsys.readouterr().err == ""
    assert VerifierConfig.from_args(["--drafter", "127.0.0.1:6"]).drafter == "127.0.0.1:6"
    assert "--drafter is deprecated, use --drafter-addr" in capsys.readouterr().err


def test_static_shapes_flags_and_what_they_refuse():
    """--static-shapes on: one bucket of 16 by default, sessions batched unless --batching off; a TP group
    of several ranks and buckets outside a tree's rows are refused, naming the setting."""
    cfg = VerifierConfig.from_args(["--static-shapes", "on"])
    cfg.validate()
    assert cfg.static_buckets == (16,) and cfg.batched  # one thread, yet batched: exact by construction
    assert not VerifierConfig(static_shapes="on", batching="off").batched
    assert VerifierConfig.from_args(["--static-buckets", "2,8,32"]).static_buckets == (2, 8, 32)
    with pytest.raises(SystemExit):
        VerifierConfig.from_args(["--static-buckets", "eight"])
    with pytest.raises(ValueError, match="static_shapes: on needs --tp 1"):
        VerifierConfig(static_shapes="on", tp=2).validate()
    with pytest.raises(ValueError, match="static_buckets: each must be in"):
        VerifierConfig(static_buckets=(0, 8)).validate()
    with pytest.raises(ValueError, match="static_buckets: each must be in"):
        VerifierConfig(static_buckets=(66,)).validate()
