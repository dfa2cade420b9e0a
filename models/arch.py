"""ModelArch: the fields of a checkpoint's config.json that shape the graph, parsed once.

Reads the raw JSON (not a transformers config object) so both the old (`rope_theta`, `rope_scaling`)
and the new (`rope_parameters`) spellings work, whatever transformers version is installed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ModelArch:
    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_scaling: dict | None
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelArch:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{model_dir} has no config.json: not a Hugging Face checkpoint directory"
            )
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(cfg)

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelArch:
        from models.registry import check_supported

        archs = cfg.get("architectures") or []
        arch = check_supported(archs[0] if archs else cfg.get("model_type", "<none>"))
        model_type = cfg.get("model_type", "")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        is_qwen2 = model_type == "qwen2"
        uses_window = cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type == "mistral")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (atomc's families use silu)")
        return cls(
            architecture=arch,
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
            o_bias=not is_qwen2 and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            sliding_window=cfg["sliding_window"] if uses_window else None,
            raw=cfg,
        )


def layer_sliding_window(arch, layer_idx: int) -> int:
    """One layer's attention window in tokens, 0 for full attention. `layer_types` (written by recent
    transformers) names each layer's kind; older Qwen2 configs slide only from `max_window_layers` on.
    Reads attributes with defaults, so test stand-ins for ModelArch need not carry them."""
    window = getattr(arch, "sliding_window", None)
    if not window:
        return 0
    raw = getattr(arch, "raw", None) or {}
    types = raw.get("layer_types")
    if types:
        return window if types[layer_idx] == "sliding_attention" else 0
    first = raw.get("max_window_layers") if getattr(arch, "model_type", "") == "qwen2" else None
    return window if first is None or layer_idx >= first else 0
