"""Tests for TP groups that span machines (verifier_service.tp_join and tp_group's remote ranks):
rank 0 waits at `--tp-listen`, and ranks started elsewhere join with `python -m
verifier_service.tp_group --master HOST:PORT`. Real processes on 127.0.0.1, gloo, one torch
thread per rank; a "remote" rank is a process the test starts itself, in another directory and
without rank 0's environment, never a child of rank 0.

- The verifier CLI with `--tp 2 --tp-local-ranks 1 --tp-listen` plus a rank-1 worker started on
  its own (the bundled SmolLM2: a GGUF the worker resolves itself): greedy output through gRPC
  is token-identical to one rank, rank 0 has no child ranks, and the worker stops with rank 0.
- A remote rank that never joins: the start fails within its timeout with a TimeoutError naming
  the rank. A rank started for another world size (here a two-rank "pod", `--local-ranks 2`),
  or with other weights, refuses with a clear error, and rank 0's start fails at once saying why.
- The worker CLI: flags, the torchrun environment, the LeaderWorkerSet mapping; bad values refused.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from transformers import LlamaConfig

from specmesh.engine import StopConditions, generate
from specmesh.runtime import encode_prompt, load_target
from specmesh.sampling import SamplingParams
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from tests.e2e.procs import start
from tests.tiny_models import random_hf_model
from verifier_service.tp_group import start_tp
from verifier_service.tp_join import TPStartError, parse_worker_args

ROOT = Path(__file__).resolve().parents[2]
RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LWS_LEADER_ADDRESS",
            "LWS_WORKER_INDEX", "LWS_GROUP_SIZE", "GPUS_PER_POD", "SPECMESH_TARGET")


@pytest.fixture(autouse=True)
def _threads():
    """start_tp sets this process's thread count; give the other tests theirs back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _tiny(path: Path, seed: int) -> Path:
    """A seeded random Llama, 4 query / 4 K/V heads (TP up to 4), saved as an HF folder."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                      tie_word_embeddings=False)
    random_hf_model(cfg, seed).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory.mktemp("tiny"), seed=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _remote(log: Path, *args: str) -> subprocess.Popen:
    """`python -m verifier_service.tp_group ARGS` as another machine would run it: its own cwd, no
    rank variables from this process, output to `log`."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p))
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "verifier_service.tp_group", "--threads", "1", *args],
                                cwd=log.parent, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)


def _children(pid: int) -> list[int]:
    """Pids of `pid`'s children running a TP rank."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"verifier_service.tp_group" in (d / "cmdline").read_bytes():
                found.append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue  # not a process, or it exited while we looked
    return found


def _reap(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(30)


# --- a group over "machines" ---------------------------------------------------------------------


@pytest.mark.e2e
def test_verifier_with_a_remote_rank_generates_what_one_rank_does(tmp_path):
    """Rank 0 = the verifier CLI with no local rank but itself; rank 1 = a process elsewhere."""
    model, tok = load_target(None)
    ids = encode_prompt(tok, "Name three primary colors.", chat=True)
    want = generate(model, ids, SamplingParams(), StopConditions(16, frozenset([tok.eos_token_id]))).token_ids
    port = _free_port()
    rank1 = _remote(tmp_path / "rank1.log", "--master", f"127.0.0.1:{port}", "--rank", "1", "--world", "2")
    # no --target: the bundled GGUF, resolved by rank 1 itself
    try:
        v = start("verifier_service", "--tp", "2", "--tp-local-ranks", "1", "--tp-listen", f"127.0.0.1:{port}",
                  "--threads", "1", "--tp-start-timeout-s", "150")
        try:
            assert _children(v.popen.pid) == [], "rank 1 must be the remote process, not rank 0's child"
            req = verifier_pb2.GenerateRequest(max_tokens=16)
            req.token_ids.ids.extend(ids)
            with grpc.insecure_channel(v.address) as ch:
                got = [t for r in verifier_pb2_grpc.VerifierStub(ch).Generate(req, timeout=120)
                       if r.HasField("chunk") for t in r.chunk.token_ids]
            assert got == want and len(want) > 4
        finally:
            v.stop()
        assert rank1.wait(30) == 0, (tmp_path / "rank1.log").read_text()  # told to STOP by rank 0's shutdown
    finally:
        _reap(rank1)


def test_a_remote_rank_that_never_joins_fails_the_start_naming_it(tiny):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 1 of 2 not ready after 2 s: rank 1 never joined") as e:
        start_tp(tiny, 2, listen="127.0.0.1:0", local_ranks=1, start_timeout_s=2)
    assert "python -m verifier_service.tp_group --master" in str(e.value)  # says how to start it
    assert time.monotonic() - t0 < 2 + 15
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("case", ["world", "weights"])
def test_a_rank_of_another_group_refuses_and_rank_0_says_why(tiny, tmp_path, case):
    """world: a "pod" of ranks 1-2 of a world of 3 (`--local-ranks 2`) meets a rank 0 of 2 ranks;
    its supervisor stops both and exits 1. weights: rank 1 of the right world, another checkpoint
    of the same architecture."""
    port = _free_port()
    master = ["--master", f"127.0.0.1:{port}", "--rank", "1"]
    if case == "world":
        rank1 = _remote(tmp_path / "rank1.log", "--target", str(tiny), *master, "--world", "3", "--local-ranks", "2")
    else:
        rank1 = _remote(tmp_path / "rank1.log", "--target", str(_tiny(tmp_path / "other", seed=1)), *master,
                        "--world", "2")
    why = {"world": r"started for a world of 3 ranks, but rank 0 leads 2",
           "weights": r"has the config of rank 0's but other weights"}[case]
    try:
        t0 = time.monotonic()
        with pytest.raises(TPStartError, match=f"rank {'[12]' if case == 'world' else '1'} refused to join: .*{why}"):
            start_tp(tiny, 2, listen=f"127.0.0.1:{port}", local_ranks=1, start_timeout_s=60)
        assert time.monotonic() - t0 < 40, "rank 0 learns of the refusal at once, not at its timeout"
        assert rank1.wait(30) == 1
        log = (tmp_path / "rank1.log").read_text()
        assert "cannot join rank 0's group" in log and re.search(why, log), log
        if case == "world":  # the supervisor stops the pod's other rank too
            assert re.search(r"rank [12] exited with code 1; stopping this machine's other ranks", log), log
    finally:
        _reap(rank1)


# --- the worker CLI ------------------------------------------------------------------------------


def test_worker_settings_from_flags_the_torchrun_env_and_a_leaderworkerset():
    w = parse_worker_args(["--master", "10.0.0.5:29500", "--rank", "4", "--world", "8", "--local-ranks", "4"], {})
    assert (w.master, w.rank, w.world, w.local_ranks, w.local_rank, w.target) == (("10.0.0.5", 29500), 4, 8, 4, 0,
                                                                                   None)
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "7", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
           "SPECMESH_TARGET": "/models/t", "SPECMESH_THREADS": "2"}
    w = parse_worker_args([], env)
    assert (w.master, w.rank, w.world, w.local_ranks, w.local_rank, w.target, w.threads) == (("h", 7), 3, 4, 1, 1,
                                                                                            "/models/t", 2)
    assert parse_worker_args(["--rank", "2"], env).rank == 2  # flags win
    lws = {"LWS_LEADER_ADDRESS": "vf-0.vf.ns", "LWS_WORKER_INDEX": "2", "LWS_GROUP_SIZE": "3", "GPUS_PER_POD": "8"}
    w = parse_worker_args(["--lws"], lws)
    assert (w.master, w.rank, w.world, w.local_ranks) == (("vf-0.vf.ns", 29500), 16, 24, 8)
    assert parse_worker_args(["--lws"], {**lws, "MASTER_PORT": "1234"}).master == ("vf-0.vf.ns", 1234)


@pytest.mark.parametrize("argv,env,err", [
    ([], {}, "--master"),
    (["--master", "h:1", "--world", "2"], {}, "--rank"),
    (["--master", "nonsense", "--rank", "1", "--world", "2"], {}, "HOST:PORT"),
    (["--master", "h:1", "--rank", "0", "--world", "2"], {}, "rank 0 is the verifier"),
    (["--master", "h:1", "--rank", "1", "--world", "4", "--local-ranks", "4"], {}, "ranks 1..4 are not among"),
    (["--lws"], {"LWS_LEADER_ADDRESS": "a", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}, "GPUS_PER_POD"),
    (["--lws"], {"GPUS_PER_POD": "8"}, "LWS_"),
])
def test_worker_settings_refuse_what_cannot_join(argv, env, err, capsys):
    with pytest.raises(SystemExit):
        parse_worker_args(argv, env)
    assert err in capsys.readouterr().err


def test_verifier_flags_for_remote_ranks(monkeypatch):
    from verifier_service.config import VerifierConfig

    cfg = VerifierConfig.from_args(["--tp", "16", "--tp-local-ranks", "8", "--tp-listen", "0.0.0.0:29500"])
    assert (cfg.tp, cfg.tp_local_ranks, cfg.tp_listen) == (16, 8, "0.0.0.0:29500")
    monkeypatch.setenv("SPECMESH_TP_LISTEN", "0.0.0.0:1")
    monkeypatch.setenv("SPECMESH_TP_LOCAL_RANKS", "2")
    monkeypatch.setenv("SPECMESH_TP_START_TIMEOUT_S", "30")
    cfg = VerifierConfig.from_args(["--tp", "4"])
    assert (cfg.tp_listen, cfg.tp_local_ranks, cfg.tp_start_timeout_s) == ("0.0.0.0:1", 2, 30.0)
    for bad in (["--tp", "2", "--tp-local-ranks", "3", "--tp-listen", "h:1"], ["--tp", "4", "--tp-listen", "h"]):
        with pytest.raises(SystemExit):
            VerifierConfig.from_args(bad)
    monkeypatch.delenv("SPECMESH_TP_LISTEN")
    with pytest.raises(SystemExit):  # ranks elsewhere with nowhere to join
        VerifierConfig.from_args(["--tp", "4"])
