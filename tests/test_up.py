"""`specmesh up` end to end (real processes, bundled SmolLM2, one torch thread each): the demo
streams text and prints stats then exits 0; SIGTERM stops every child; a child that dies is
reported by name, exit code and output, and takes the cluster down with a non-zero exit. Plus
the pure parts: config checks and crash reports."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.cluster import ClusterSpec, crash_report, describe_exit
from specmesh.drafters import bundled_drafter_path
from specmesh.up import add_arguments, config_from_args
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.certs import make_pki
from tests.up_proc import UpProcess, alive, in_groups


def test_redis_urls_are_listed_without_their_password():
    from specmesh.redis_server import redacted

    assert redacted("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redacted("rediss://user:s3cret@h:1/0") == "rediss://user:***@h:1/0"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def parse(*argv: str):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


def test_flags_become_the_cluster_spec():
    cfg = parse("--drafters", "2", "--tp", "2", "--redis-url", "redis://127.0.0.1:1/0", "--port", "5", "--demo")
    assert cfg.cluster == ClusterSpec(drafters=2, tp=2, redis_url="redis://127.0.0.1:1/0", port=5,
                                      drafter=f"model:{bundled_drafter_path()}")  # auto: the shipped drafter
    assert cfg.demo and cfg.cluster.threads == 0  # auto
    assert cfg.cluster.dtype == "auto"  # a GGUF served as it ships (specmesh.service.DEFAULT_DTYPE)
    assert parse("--dtype", "float32").cluster.dtype == "float32"


def test_auto_threads_give_each_service_the_cores_and_a_tp_rank_its_share(monkeypatch):
    from specmesh import kernels

    monkeypatch.setattr(kernels, "cpu_count", lambda: 8)
    assert ClusterSpec().service_threads() == (8, 8)
    assert ClusterSpec(tp=2).service_threads() == (8, 4)
    assert ClusterSpec(tp=16).service_threads() == (8, 1)
    assert ClusterSpec(threads=3, tp=2).service_threads() == (3, 3)
    with pytest.raises(ValueError, match="threads"):
        ClusterSpec(threads=-1).validate()
    assert parse("--target", "/x.gguf").cluster.drafter == "ngram"  # auto with another target


def test_service_children_wait_passively_unless_the_environment_says_otherwise(monkeypatch):
    from specmesh.launch import service_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = service_env({"SPECMESH_SERVICE_TOKEN": "t"})
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["SPECMESH_SERVICE_TOKEN"] == "t"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert "OMP_WAIT_POLICY" not in service_env({"OMP_WAIT_POLICY": None})  # a caller may unset it
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own choice wins
    assert service_env()["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.parametrize("argv, field", [
    (("--tp", "0"), "tp"), (("--drafters", "-1"), "drafters"), (("--drafter", "oracle:0.8"), "drafter"),
    (("--redis-url", "localhost:6379"), "redis_url"), (("--max-tokens", "0"), "max_tokens"),
    (("--dtype", "fp8"), "dtype"),
    (("--tls-cert", __file__), "tls_cert, tls_key, tls_ca"),
    (("--tls-cert", "/nonexistent.pem", "--tls-key", __file__, "--tls-ca", __file__), "tls_cert"),
])
def test_bad_flags_are_refused_naming_the_setting(argv, field):
    with pytest.raises(ValueError, match=field):
        parse(*argv)


def test_crash_report_names_the_child_its_exit_and_its_last_lines():
    report = crash_report("drafter-0", 42, -9, ["loading\n", "Traceback: boom\n"])
    assert report.startswith("drafter-0 (pid 42) exited with code -9 (SIGKILL); its last output:")
    assert report.endswith("  | loading\n  | Traceback: boom\n")
    assert describe_exit(3) == "code 3" and crash_report("x", 1, 1, []).endswith("it printed nothing")


def demo(*argv: str) -> tuple[UpProcess, str]:
    """`specmesh up --demo ...` run to its end: the process (stopped) and its stdout; it exited 0."""
    up = UpProcess("--demo", "--prompt", "Name three primary colors.", *argv)
    try:
        code = up.wait(timeout=240)
    finally:
        up.kill()
    assert code == 0, up.output()
    return up, "\n".join(up.out)


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_streams_text_prints_stats_and_exits_0():
    up, out = demo("--max-tokens", "16")
    assert "specmesh ready: grpc 127.0.0.1:" in out
    stats = re.search(r"^(\d+) tokens in [\d.]+ s \(.*\), finish: (stop|length)$", out, re.MULTILINE)
    assert stats and 1 <= int(stats.group(1)) <= 16, up.output()
    prompt = ">>> Name three primary colors."
    text = out[out.index(prompt) + len(prompt): stats.start()]
    assert len(text.strip()) > 5, up.output()  # the generated text, streamed before the stats
    spec = r"^speculation: \d+ verify steps, (\d+) drafted, \d+ accepted \(acceptance [\d.]+"
    drafted = re.search(spec, out, re.MULTILINE)
    # the verifier reached its drafter with the service token (on by default)
    assert drafted and int(drafted.group(1)) > 0, up.output()
    assert "require a service token" in out
    assert not in_groups(set(up.pids().values()))


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_with_tls_between_every_service(tmp_path):
    """--tls-*: the router serves TLS, services talk mTLS (drafter health checks included), and
    the demo client verifies the router with the CA: the generation runs with speculation."""
    pki = make_pki(tmp_path)
    up, out = demo("--max-tokens", "12", "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
                   "--tls-ca", pki.ca)
    assert re.search(r"^specmesh ready: grpc 127.0.0.1:\d+ http https://127.0.0.1:\d+$", out, re.MULTILINE), out
    drafted = re.search(r"^speculation: \d+ verify steps, (\d+) drafted", out, re.MULTILINE)
    assert drafted and int(drafted.group(1)) > 0, up.output()  # the verifier reached the drafter over mTLS


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_stops_every_child_in_reverse_order():
    up = UpProcess("--drafters", "2")
    try:
        up.wait_ready()
        pids = up.pids()
        assert set(pids) == {"redis", "router", "drafter-0", "drafter-1", "verifier"}
        assert all(alive(p) for p in pids.values())
        # the embedded Redis wants its generated password, which is in no command line or listing
        listed = next(line for line in up.out if line.split()[:1] == ["redis"])
        port = int(re.search(r"127\.0\.0\.1:(\d+)", listed).group(1))
        assert ":***@" in listed, listed
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"PING\r\n")
            assert sock.recv(64).startswith(b"-NOAUTH"), "an unauthenticated client was served"
        for pid in pids.values():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert b"redis://" not in cmdline and b"requirepass" not in cmdline, cmdline
            assert b"service-token" not in cmdline and b"SPECMESH_SERVICE_TOKEN" not in cmdline, cmdline
        for name in ("verifier", "drafter-0", "drafter-1"):  # model services get the cluster's --dtype
            assert b"--dtype\x00auto\x00" in Path(f"/proc/{pids[name]}/cmdline").read_bytes(), name
            # and wait passively between parallel regions (they share the cores)
            environ = Path(f"/proc/{pids[name]}/environ").read_bytes().split(b"\x00")
            assert b"OMP_WAIT_POLICY=PASSIVE" in environ, name
        # the internal ports refuse a caller without the service token; their health stays open
        listed = {line.split()[0]: line.split()[1] for line in up.out if line.startswith("  ") and len(line.split()) > 1}
        with grpc.insecure_channel(listed["verifier"]) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(verifier_pb2_grpc.VerifierStub(ch).Generate(
                    verifier_pb2.GenerateRequest(token_ids=verifier_pb2.TokenIds(ids=[1, 2]), max_tokens=1), timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(listed["drafter-0"]) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(drafter_pb2_grpc.DrafterStub(ch).Draft(iter([drafter_pb2.DrafterRequest(session_id="x")]),
                                                            timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        up.signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0, up.output()
    finally:
        up.kill()
    assert not [n for n, p in pids.items() if alive(p)]
    assert not in_groups(set(pids.values()))
    stops = [line.split("stopping ", 1)[1].split(" ")[0] for line in up.err if "stopping " in line]
    assert stops[0] == "verifier" and stops[-2:] == ["router", "redis"], stops


@pytest.mark.e2e
@pytest.mark.slow
def test_a_child_that_dies_is_reported_and_restarted_while_the_rest_serves():
    """kill -9 of the drafter: its crash is reported, it is started again on the same address,
    and the cluster goes on serving (a generation through the router afterwards streams, with
    speculation); SIGTERM still stops everything."""
    from specmesh.client import Client

    up = UpProcess()
    try:
        grpc_address, _ = up.wait_ready()
        pids = up.pids()
        victim = pids["drafter-0"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while not any("drafter-0 restarted" in line for line in up.err):
            assert up.popen.poll() is None and time.monotonic() < deadline, up.output()
            time.sleep(0.2)
        err = "\n".join(up.err)
        assert f"drafter-0 (pid {victim}) exited with code -9 (SIGKILL)" in err
        with Client(grpc_address, timeout=120) as client:
            done = client.complete("Name three colours.", max_tokens=12)
        assert len(done.token_ids) == 12 or done.finish_reason == "stop", done
        assert up.popen.poll() is None
        up.signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0, up.output()
    finally:
        up.kill()
    assert not in_groups(set(pids.values()))
