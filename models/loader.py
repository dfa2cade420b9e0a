"""Load a Hugging Face checkpoint directory (config.json + one or sharded *.safetensors).

Safetensors only: atomc never unpickles a checkpoint. The model is built on the meta device and
materialised once on the target device, so no random init runs and no second copy is made.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from models.arch import ModelArch
from models.registry import build_model

# checkpoint keys that carry no weights atomc needs (recomputed buffers)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt*")
        )
        hint = f" (found {', '.join(found)}: atomc does not load pickled weights)" if found else ""
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights{hint}")
    return files


def load_model(
    model_dir: Path, dtype: torch.dtype, device: str | torch.device, load_format: str = "safetensors"
) -> torch.nn.Module:
    """load_format "dummy" fills random weights instead of reading files (benchmarks of large shapes)."""
    arch = ModelArch.from_dir(model_dir)
    with torch.device("meta"):
        model = build_model(arch)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    if load_format == "dummy":
        fill_dummy_weights(model)
    elif load_format == "safetensors":
        load_weights(model, checkpoint_files(model_dir))
    else:
        raise ValueError(f"load format {load_format!r} is not one of: safetensors, dummy")
    return model.eval()


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def load_weights(model: torch.nn.Module, files: list[Path]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model, "arch", None) is not None and model.arch.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in params:
                    unexpected.append(name)
                    continue
                tensor = f.get_tensor(name)
                param = params[name]
                if tensor.shape != param.shape:
                    raise ValueError(
                        f"{path.name}: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(name)
    if tied and "lm_head.weight" not in loaded:
        loaded.add("lm_head.weight")  # shares embed_tokens.weight
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
        raise ValueError("checkpoint does not match the model's parameters; " + "; ".join(parts))
