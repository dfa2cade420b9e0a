"""GGUF checkpoints -> plain Hugging Face folders (config.json, model.safetensors, tokenizer files).

atomc's loader reads only HF folders, so a GGUF file is converted once, through transformers' own
GGUF reader (it dequantises with the `gguf` library and undoes llama.cpp's q/k rope permutation),
and the folder is cached. Conversions are atomic and guarded by a file lock, so concurrent
processes never see or write a half-converted folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

# Bump when the written folder changes (layout, files, marker): old cache entries are then ignored.
CONVERSION_FORMAT_VERSION = 1
MARKER = ".converted"
_EDGE_BYTES = 1 << 20  # the cache key hashes this much of each end of the file
_MAGIC = b"GGUF"


def check_gguf_file(gguf_file: Path) -> Path:
    """The file as an absolute path, or a clear error if it is missing or not a GGUF file."""
    gguf_file = Path(gguf_file).expanduser().resolve()
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")
    with gguf_file.open("rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise ValueError(f"{gguf_file} is not a GGUF file (its first bytes are {magic!r}, not {_MAGIC!r})")
    return gguf_file


def cached_conversion_dir(gguf_file: Path, cache_root: Path, dtype: str = "bfloat16") -> Path:
    """Where the converted folder of this file lives: `cache_root/models/<stem>-<digest16>`.

    The digest covers the size and both 1 MiB ends of the file (the header and the last tensors),
    which tells real checkpoints apart without hashing gigabytes on every start.
    """
    gguf_file = check_gguf_file(gguf_file)
    size = gguf_file.stat().st_size
    h = hashlib.sha256(f"atomc-gguf v{CONVERSION_FORMAT_VERSION} {dtype} {size}\n".encode())
    with gguf_file.open("rb") as f:
        h.update(f.read(_EDGE_BYTES))
        f.seek(max(0, size - _EDGE_BYTES))
        h.update(f.read(_EDGE_BYTES))
    return Path(cache_root) / "models" / f"{gguf_file.stem}-{h.hexdigest()[:16]}"


def is_converted(out_dir: Path) -> bool:
    return (Path(out_dir) / MARKER).is_file()


def convert_gguf(gguf_file: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Convert `gguf_file` into an HF folder at `out_dir` and return it; a finished folder is reused."""
    gguf_file = check_gguf_file(gguf_file)
    out_dir = Path(out_dir).expanduser().resolve()
    if is_converted(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # `<name>.lock`, not with_suffix: converted names contain dots ("...Q4_1-<digest>")
    with FileLock(str(out_dir.with_name(out_dir.name + ".lock"))):
        if is_converted(out_dir):  # another process finished it while we waited
            return out_dir
        if out_dir.exists():
            if any(out_dir.iterdir()):
                raise FileExistsError(f"{out_dir} exists but is not a finished GGUF conversion; remove it")
            out_dir.rmdir()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            _write_hf_folder(gguf_file, tmp, dtype)
            marker = {
                "format_version": CONVERSION_FORMAT_VERSION,
                "source": gguf_file.name,
                "source_size": gguf_file.stat().st_size,
                "dtype": dtype,
                "transformers_version": _transformers_version(),
            }
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            # mkdtemp (and safetensors) create owner-only entries; a shared cache must be readable
            os.chmod(tmp, 0o755)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            os.replace(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


_SPECIAL_IDS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


def read_gguf_facts(gguf_file: Path) -> dict:
    """What the file itself says, read with the `gguf` library: the architecture, the tokenizer
    type and its special tokens (e.g. {"arch": "llama", "tokenizer": "gpt2", "eos_token": "<|im_end|>"})."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_file)).fields

    def scalar(key):
        f = fields.get(key)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types[0].name == "STRING" else value.item()

    facts = {"arch": scalar("general.architecture"), "tokenizer": scalar("tokenizer.ggml.model")}
    if facts["arch"] is None:
        raise ValueError(f"{gguf_file} has no general.architecture key; it is not a model GGUF file")
    tokens = fields.get("tokenizer.ggml.tokens")
    for name, key in _SPECIAL_IDS.items():
        token_id = scalar(f"tokenizer.ggml.{key}_token_id")
        if tokens is not None and token_id is not None and token_id < len(tokens.data):
            facts[name] = bytes(tokens.parts[tokens.data[token_id]]).decode()
    return facts


def _write_hf_folder(gguf_file: Path, out: Path, dtype: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never ask the hub
    if importlib.util.find_spec("accelerate") is None:  # transformers refuses gguf_file= without it
        raise ModuleNotFoundError(f"converting {gguf_file} needs accelerate: pip install accelerate")
    import torch
    import transformers

    facts = read_gguf_facts(gguf_file)
    src, name = str(gguf_file.parent), gguf_file.name
    common = dict(gguf_file=name, local_files_only=True)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(src, **common)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            src, dtype=getattr(torch, dtype), low_cpu_mem_usage=True, **common, **_dequantize_kwargs()
        )
    except (ValueError, KeyError, NotImplementedError) as e:
        what = f"transformers {_transformers_version()} cannot read {gguf_file}"
        raise ValueError(f"{what} (GGUF architecture {facts['arch']!r}): {e}") from e
    _make_gguf_model_saveable(model)
    model.save_pretrained(out)
    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len:  # a GGUF tokenizer otherwise claims an unbounded length
        tokenizer.model_max_length = max_len
    _fix_gguf_tokenizer(tokenizer, facts)
    # The chat template goes into tokenizer_config.json, where every reader (4.x, 5.x, ours) finds it.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    _drop_loader_state(out / "tokenizer_config.json")


def _dequantize_kwargs() -> dict:
    """Ask for a dense (dequantised) model; transformers >= 5.2x would otherwise keep GGUF blocks."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older versions always dequantise
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _make_gguf_model_saveable(model) -> None:
    """Transformers-version workaround, kept in one place.

    Some 5.x releases attach a GGUF quantizer and `config.quantization_config` to the loaded model
    even when it was dequantised, and `save_pretrained` then refuses it as "not serializable". The
    weights are plain dense tensors by now, so dropping both gives a normal checkpoint.
    """
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if "quantization_config" in vars(model.config):
        del model.config.quantization_config


def _fix_gguf_tokenizer(tokenizer, facts: dict) -> None:
    """Transformers-version workaround: make the tokenizer say what the GGUF file says.

    transformers 5.17 builds GGUF tokenizers with eos_token = the BOS token, and for some byte-level
    (tokenizer.ggml.model "gpt2") files a decoder that strips the first space, plus
    clean_up_tokenization_spaces=True, which eats spaces before punctuation; 5.24 gets these right.
    """
    for name in _SPECIAL_IDS:
        if facts.get(name) is not None and getattr(tokenizer, name, None) != facts[name]:
            setattr(tokenizer, name, facts[name])
    if facts["tokenizer"] == "gpt2":
        from tokenizers import decoders

        tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()
        tokenizer.clean_up_tokenization_spaces = False


def _drop_loader_state(tokenizer_config: Path) -> None:
    """5.x writes how *this* load happened (`is_local`, `local_files_only`) into the config; drop it."""
    cfg = json.loads(tokenizer_config.read_text())
    for key in ("is_local", "local_files_only", "gguf_file"):
        cfg.pop(key, None)
    tokenizer_config.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
