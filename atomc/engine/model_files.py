"""What a rank resolves from the config before it builds a runner: device, model folder, arch,
dtype and context length. The engine (rank 0) and a torchrun-started worker (launched_worker.py)
resolve them the same way from the same flags."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from atomc.config import EngineConfig, resolve_device, resolve_dtype
from models.arch import ModelArch
from models.loader.default_model import resolve_model_path


class ModelFiles(NamedTuple):
    device: str
    model_dir: Path
    arch: ModelArch
    dtype: torch.dtype
    max_model_len: int


def resolve_model(config: EngineConfig) -> ModelFiles:
    device = resolve_device(config.device)
    model_dir = resolve_model_path(config.model.model, config.cache_path)
    arch = ModelArch.from_dir(model_dir)
    dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, device)
    return ModelFiles(device, model_dir, arch, dtype, max_model_len(arch, config))


def max_model_len(arch: ModelArch, config: EngineConfig) -> int:
    """--max-model-len, checked against the model's limit (its limit when not given)."""
    limit = arch.max_position_embeddings
    asked = config.model.max_model_len
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(f"--max-model-len {asked} exceeds what the model supports ({limit})")
    return asked
