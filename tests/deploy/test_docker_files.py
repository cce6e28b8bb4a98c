"""The Dockerfiles in deploy/docker, read as Docker would (no engine runs here): pinned bases, a
non-root final user, torch pinned as in pyproject.toml (CPU wheel index for the CPU image), every
package of the project copied in and not dropped by the .dockerignore, and the same writable paths
and image tags as the Kubernetes manifests."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SERVICE_PORTS = {50050, 8000, 50051, 50052, 9090}  # router gRPC + HTTP, verifier, drafter, metrics (deploy/k8s)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        op, _, args = buf.strip().partition(" ")
        out.append((op.upper(), args.strip()))
        buf = ""
    return out


def stages(path: Path) -> list[dict]:
    """Stages with their base image (global ARG defaults substituted) and instructions."""
    args, result = {}, []
    for op, rest in instructions(path):
        if op == "ARG" and not result:
            name, _, default = rest.partition("=")
            args[name] = default
        elif op == "FROM":
            image, _, alias = rest.partition(" AS ")
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image.strip())
            result.append({"image": image, "alias": alias.strip() or None, "ops": []})
        else:
            result[-1]["ops"].append((op, rest))
    return result


def ignored(patterns: list[str], path: str) -> bool:
    """.dockerignore semantics for the patterns we use: last match wins, `!` re-includes, a
    pattern matches a path or any of its parent directories."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for p in patterns:
        neg = p.startswith("!")
        pat = p.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatch(c, pat) or pat.startswith("**/") and fnmatch.fnmatch(c.split("/")[-1], pat[3:])
               for c in candidates):
            result = not neg
    return result


def dockerignore(name: str) -> list[str]:
    lines = (DOCKER / f"{name}.dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_bases_are_pinned_and_the_final_user_is_not_root(name):
    st = stages(DOCKER / name)
    aliases = {s["alias"] for s in st if s["alias"]}
    for s in st:
        image = s["image"]
        if image in aliases:
            continue
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert "@sha256:" in image or (tag and tag != "latest" and "latest" not in tag), image
    final = st[-1]
    users = [rest for op, rest in final["ops"] if op == "USER"]
    assert users, "the final stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: numeric and non-root (runAsNonRoot checks it)"
    entry = [rest for op, rest in final["ops"] if op == "ENTRYPOINT"]
    assert entry and "tini" in entry[-1], "PID 1 must forward SIGTERM and reap the TP ranks"
    exposed = {int(p) for op, rest in final["ops"] if op == "EXPOSE" for p in rest.split()}
    assert SERVICE_PORTS <= exposed


@pytest.mark.parametrize("name", DOCKERFILES)
def test_torch_is_pinned_like_pyproject(name):
    pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.replace(" ", "").startswith("torch=="))
    st = stages(DOCKER / name)
    args = {rest.partition("=")[0]: rest.partition("=")[2] for s in st for op, rest in s["ops"] if op == "ARG"}
    assert f"torch=={args['TORCH_VERSION']}" == pin.replace(" ", "")
    runs = " ".join(rest for s in st for op, rest in s["ops"] if op == "RUN")
    assert '"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in runs
    if name == "Dockerfile.cpu":
        assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
        assert st[-1]["image"].startswith("python:3.11")
    else:
        assert st[-1]["image"].startswith("nvidia/cuda:") and "runtime" in st[-1]["image"]
        assert "python3.11" in runs
    assert re.search(r"pip install \. ", runs), "the project itself is installed (not editable)"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_package_is_copied_and_not_ignored(name):
    patterns = dockerignore(name)
    copies = [rest.split()[:-1] for s in stages(DOCKER / name) for op, rest in s["ops"]
              if op == "COPY" and "--from" not in rest]
    sources = {src.rstrip("/") for srcs in copies for src in srcs}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", PYPROJECT["project"]["readme"]} <= sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not ignored(patterns, src), f"{src} is copied but .dockerignore drops it"
    for py in (ROOT / "specmesh" / "v1").glob("*_pb2*.py"):  # generated code is committed and needed
        assert not ignored(patterns, str(py.relative_to(ROOT)))
    for junk in (".git/HEAD", "tests/test_tree.py", "specmesh/__pycache__/x.pyc", "loadtest/results/a.json"):
        assert ignored(patterns, junk), junk


def test_dockerignores_agree():
    assert dockerignore("Dockerfile.cpu") == dockerignore("Dockerfile.cuda")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_env_matches_the_kubernetes_config(name):
    """The image's defaults and the k8s ConfigMap agree on where the cache and HOME live, and the
    manifests' image tags are this project version."""
    kust = yaml.safe_load((ROOT / "deploy" / "k8s" / "base" / "kustomization.yaml").read_text())
    gen = next(g for g in kust["configMapGenerator"] if g["name"] == "specmesh-env")
    k8s_env = dict(lit.split("=", 1) for lit in gen["literals"])
    env_lines = " ".join(rest for op, rest in stages(DOCKER / name)[-1]["ops"] if op == "ENV")
    image_env = dict(re.findall(r"(\w+)=(\S+)", env_lines))
    for var in ("HOME", "SPECMESH_CACHE", "HF_HOME", "HF_HUB_OFFLINE"):
        assert image_env[var] == k8s_env[var], var
    flavour = name.rsplit(".", 1)[1]
    overlays = {"cpu": ["base", "overlays/cpu-dev"], "cuda": ["overlays/gpu", "overlays/gpu-multinode"]}[flavour]
    for d in overlays:
        k = yaml.safe_load((ROOT / "deploy" / "k8s" / d / "kustomization.yaml").read_text())
        tag = next(i["newTag"] for i in k["images"] if i["name"] == "specmesh")
        assert tag == f"{PYPROJECT['project']['version']}-{flavour}", d
