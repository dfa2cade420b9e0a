"""ModelArch: the fields of a checkpoint's config.json that the runtime needs, for every family alike.

Layers, heads, head_dim, vocabulary, positions, special tokens, dtype, sliding window, tied
embeddings; nothing family-specific. Each family parses the rest of `raw` itself (models/llama.py,
qwen2.py, ...). Parsing imports no model code (the registry names classes as strings), so the
engine can read a config without importing torch modules or registering ops. The raw JSON is read
(not a transformers config object), so it works whatever transformers version wrote the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ModelArch:
    architecture: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelArch:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face checkpoint directory")
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
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        # Qwen2/Qwen3 write a window but switch it off with use_sliding_window; Mistral has no switch
        uses_window = cfg.get("sliding_window") and cfg.get("use_sliding_window", True)
        return cls(
            architecture=arch,
            model_type=cfg.get("model_type", ""),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            sliding_window=cfg["sliding_window"] if uses_window else None,
            raw=cfg,
        )

    def layer_sliding_windows(self) -> list[int | None]:
        """Each layer's window for its KV spec (None: full attention)."""
        types = self.raw.get("layer_types")
        if self.sliding_window and types and len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {self.num_layers} layers")
        return [layer_sliding_window(self, i) or None for i in range(self.num_layers)]


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
