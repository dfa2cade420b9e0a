"""Checkpoint folders with the real configs of 8B models and a synthetic tokenizer, for benchmarks.

Weights are not written: engines load them with `load_format="dummy"` (atomc) or random init
(transformers), so a benchmark needs only config.json and a tokenizer of the right vocabulary size.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIGS = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}


def synthetic_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """A word-level tokenizer with one token per id ("t0", "t1", ...): any id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", bos_token="t2")
    fast.save_pretrained(out_dir)


def make_checkpoint(name: str, root: Path) -> Path:
    out = Path(root) / name
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = CONFIGS[name]
    synthetic_tokenizer(cfg["vocab_size"], out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def weight_bytes(name: str, dtype_bytes: int = 2) -> int:
    """Bytes of weights one decode step streams (every parameter once; embeddings read one row)."""
    c = CONFIGS[name]
    h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d, hq, hkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    per_layer = h * d * (hq + 2 * hkv) + hq * d * h + 3 * h * i + 2 * h
    return dtype_bytes * (n * per_layer + c["vocab_size"] * h + h)


if __name__ == "__main__":
    import sys

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_models")
    for name in CONFIGS:
        print(make_checkpoint(name, root))
