"""Checkpoint folders with the real configs of benchmark models and a synthetic tokenizer.

Weights are not written: engines load them with `load_format="dummy"` (atomc) or random init
(transformers), so a benchmark needs only config.json and a tokenizer of the right vocabulary size.

The dense 8B shapes (and Llama-3.1-70B's, for the tensor-parallel runs), and three mixtures of
experts whose config.json is the published one (Hugging Face model repos, fields as they ship):
mistralai/Mixtral-8x7B-Instruct-v0.1,
Qwen/Qwen3-30B-A3B and openai/gpt-oss-20b. GPT-OSS ships its experts in MXFP4: `gpt-oss-20b`
leaves its `quantization_config` out, so every engine builds bf16 experts, and `gpt-oss-20b-mxfp4`
keeps it (atomc then runs MXFP4 experts; the dummy loader fills their codes and scales).
DeepSeek-V2-Lite as published (MLA without q LoRA, softmax routing, 64 experts),
and DeepSeek-V3 at full width with few layers (`deepseek_v3_layers`: its 3 dense layers and a few
MoE layers, in bf16 without the published FP8 `quantization_config`, so one H200 holds it).
`tiny_config` shrinks any of them (2 layers, small dims, the same fields) so a benchmark's code
path can be run on a CPU before it takes GPU time.
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
    # https://huggingface.co/mistralai/Mixtral-8x7B-Instruct-v0.1/blob/main/config.json
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    },
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json without its quantization_config
    # ({"quant_method": "mxfp4", "modules_to_not_convert": [self_attn, router, embed_tokens, lm_head]})
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": 201088,
    },
    # https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json without its auto_map
    # (transformers has DeepseekV2 built in). q straight from q_proj (q_lora_rank null), softmax
    # routing without groups (n_group = topk_group = 1, greedy), two shared experts, one dense layer
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 10944,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v2",
        "moe_intermediate_size": 1408,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 27,
        "num_key_value_heads": 16,
        "pretraining_tp": 1,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "greedy",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": 102400,
    },
}
# https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json without its auto_map and its
# quantization_config (FP8 blocks of 128 x 128: bf16 here, as atomc refuses FP8 DeepSeek checkpoints);
# 61 layers there, 3 dense + 58 MoE. `deepseek_v3_layers` cuts it to fewer MoE layers.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
# MoE layers of the few-layer V3 shape by default: 3 dense + 4 MoE layers hold 99.3 GB of bf16
# weights (a MoE layer 23.0 GB, a dense one 1.17 GB, embedding + lm_head 3.7 GB), the most that
# stays under 100 GB, so an H200 keeps ~40 GB for the latent cache and activations
V3_LAYERS_MOE = 4


# DeepSeek-V3/R1's published quantization_config: block FP8 (e4m3 weights in 128 x 128 blocks with
# an fp32 scale each, activations quantised per 128-value group at run time)
DEEPSEEK_V3_FP8 = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
}  # fmt: skip


def deepseek_v3_layers(moe_layers: int = V3_LAYERS_MOE, dense_layers: int = 3, fp8: bool = False) -> dict:
    """DeepSeek-V3 at full width with `dense_layers` dense then `moe_layers` MoE layers, in bf16 or
    (`fp8`) with the published block-FP8 quantization_config. The MTP layer's config entry is kept
    (the engine builds no MTP module unless asked)."""
    if dense_layers < 0 or moe_layers < 0 or dense_layers + moe_layers < 1:
        raise ValueError(f"need at least one layer (got {dense_layers} dense + {moe_layers} MoE)")
    cfg = dict(DEEPSEEK_V3, num_hidden_layers=dense_layers + moe_layers, first_k_dense_replace=dense_layers)
    return dict(cfg, quantization_config=dict(DEEPSEEK_V3_FP8)) if fp8 else cfg


CONFIGS["deepseek-v3-layers"] = deepseek_v3_layers()
# meta-llama/Llama-3.1-70B: the 8B's fields (the same RoPE scaling, vocabulary and tokens) at its sizes
CONFIGS["llama-3.1-70b"] = {
    **CONFIGS["llama-3.1-8b"],
    "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
}  # fmt: skip
# GPT-OSS-20B as published: its experts in MXFP4 (the quantization_config of its config.json)
CONFIGS["gpt-oss-20b-mxfp4"] = {
    **CONFIGS["gpt-oss-20b"],
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
        ],
        "quant_method": "mxfp4",
    },
}  # fmt: skip

MOE_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-20b-mxfp4", "deepseek-v2-lite")
MLA_MODELS = ("deepseek-v2-lite", "deepseek-v3-layers")

# what `tiny_config` puts in place of the real sizes (every other field is kept as it is)
_TINY = {
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 512, "intermediate_size": 96, "moe_intermediate_size": 32,
}  # fmt: skip


# DeepSeek's latent attention at toy size (tests/conftest.py's MLA widths): every head has its own
# K/V in transformers' form (num_key_value_heads = heads), no head_dim field (transformers sets it
# to the rope dims), a 1-dense + 1-MoE stack, top 2 of 8 experts in at most 4 groups keeping 2
_TINY_MLA = {
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4,
}  # fmt: skip


def _tiny_mla(cfg: dict) -> None:
    cfg.update(_TINY_MLA)
    if cfg.get("q_lora_rank"):
        cfg["q_lora_rank"] = 24
    cfg["n_routed_experts"] = min(cfg["n_routed_experts"], 8)
    cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], 2)
    cfg["first_k_dense_replace"] = min(cfg.get("first_k_dense_replace") or 0, 1)
    if (cfg.get("n_group") or 1) > 1:
        cfg["n_group"], cfg["topk_group"] = min(cfg["n_group"], 4), min(cfg["topk_group"], 2)


# DeepSeek at toy widths that 128 x 128 FP8 blocks tile (tests/quant/fp8_deepseek_checkpoints.py's)
_TINY_BLOCK_FP8 = {
    "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 128, "kv_lora_rank": 128,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32,
}  # fmt: skip


def tiny_config(name: str | dict) -> dict:
    """The named config (or a config dict) at toy size: 2 layers, hidden 64, 8 experts at most
    (top-k kept where it fits), a 16-token sliding window where the model has one, so a prompt
    outruns it; DeepSeek's latent attention at toy widths too (widths 128-blocks tile where the
    config is block FP8)."""
    cfg = json.loads(json.dumps(CONFIGS[name] if isinstance(name, str) else name))  # a deep copy
    mla = "kv_lora_rank" in cfg
    for key, value in _TINY.items():
        if key in cfg or (key == "head_dim" and not mla):
            cfg[key] = value
    if mla:
        _tiny_mla(cfg)
        if (cfg.get("quantization_config") or {}).get("weight_block_size"):
            cfg.update(_TINY_BLOCK_FP8, q_lora_rank=128 if cfg.get("q_lora_rank") else None)
    for key in ("num_local_experts", "num_experts"):
        if key in cfg:
            cfg[key] = min(cfg[key], 8)
            experts = cfg[key]
            for k in ("num_experts_per_tok", "experts_per_token"):
                if k in cfg:
                    cfg[k] = min(cfg[k], experts // 2)
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][: cfg["num_hidden_layers"]]
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = 16
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(cfg.get(k), int) and cfg[k] >= cfg["vocab_size"]:
            cfg[k] = {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}[k]
    return cfg


def model_config(name: str, tiny: bool = False, layers: int | None = None) -> dict:
    cfg = tiny_config(name) if tiny else CONFIGS[name]
    return cfg if layers is None else with_layers(cfg, layers)


def with_layers(cfg: dict, layers: int) -> dict:
    """`cfg` cut to its first `layers` decoder layers (every width kept), e.g. so that a bf16 model
    and its FP8 twin both fit one card in the same call; per-layer fields are cut to match."""
    if not 1 <= layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"layers must be within 1..{cfg['num_hidden_layers']} (got {layers})")
    cfg = json.loads(json.dumps(cfg))  # a deep copy
    cfg["num_hidden_layers"] = layers
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:layers]
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(cfg["max_window_layers"], layers)
    if "first_k_dense_replace" in cfg:
        cfg["first_k_dense_replace"] = min(cfg["first_k_dense_replace"], layers)
    return cfg


# ids 3 .. 97: one printable ASCII character each, so a grammar (JSON, a regex) can spell its text
# in this vocabulary (structured-output benchmarks); every other id is a word "t<id>"
_CHAR_IDS = {chr(c): 3 + c - 32 for c in range(32, 127)}


def synthetic_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """A word-level tokenizer with one token per id: the printable ASCII characters, then "t<id>";
    tokens decode joined (no spaces added), so any id sequence decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = {ch: i for ch, i in _CHAR_IDS.items() if i < vocab_size}
    vocab = {f"t{i}": i for i in range(vocab_size) if i not in chars.values()} | chars
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", bos_token="t2")
    fast.save_pretrained(out_dir)


def make_checkpoint(name: str, root: Path, tiny: bool = False, layers: int | None = None) -> Path:
    """`root/name` (`root/name-tiny`, `root/name-{layers}l`) with config.json and the synthetic
    tokenizer; kept if there."""
    if name not in CONFIGS:
        raise ValueError(f"unknown benchmark model {name!r}; known: {', '.join(CONFIGS)}")
    suffix = ("-tiny" if tiny else "") + (f"-{layers}l" if layers is not None else "")
    return write_checkpoint(model_config(name, tiny, layers), Path(root) / (name + suffix))


def write_checkpoint(cfg: dict, out: Path) -> Path:
    """`out` with config.json = `cfg` and the synthetic tokenizer; kept if its config is `cfg`."""
    out = Path(out)
    if (out / "config.json").is_file() and json.loads((out / "config.json").read_text()) == cfg:
        return out
    out.mkdir(parents=True, exist_ok=True)
    synthetic_tokenizer(cfg["vocab_size"], out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def weight_bytes(
    name: str | dict, dtype_bytes: int = 2, linear_bytes: float | None = None, quantized_lm_head: bool = False,
    row_scale_bytes: int = 0,
) -> int:  # fmt: skip
    """Bytes of weights one decode step of a dense model streams (every parameter once; embeddings
    read one row). Mixtures of experts: `ceilings.moe_shape` counts theirs.

    Quantised weights: the decoder's linears take `linear_bytes` a value (1 for FP8 / int8) plus
    `row_scale_bytes` per output row (per-channel scales: 4 for atomc's fp32, 2 for gpt-fast's
    bf16); the LM head too where `quantized_lm_head` (gpt-fast's int8 quantises every nn.Linear;
    atomc never quantises it); norms and the embedding row stay at `dtype_bytes`."""
    c = CONFIGS[name] if isinstance(name, str) else name
    h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d, hq, hkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    linear = h * d * (hq + 2 * hkv) + hq * d * h + 3 * h * i  # per layer
    rows = d * (hq + 2 * hkv) + h + 2 * i + h  # output rows of qkv, o, gate_up, down
    head, lm_rows = c["vocab_size"] * h, c["vocab_size"]
    if linear_bytes is None:
        return dtype_bytes * (n * (linear + 2 * h) + head + h)
    total = n * (linear * linear_bytes + rows * row_scale_bytes + 2 * h * dtype_bytes) + h * dtype_bytes
    total += head * linear_bytes + lm_rows * row_scale_bytes if quantized_lm_head else head * dtype_bytes
    return int(total)


if __name__ == "__main__":
    import sys

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_models")
    for name in CONFIGS:
        print(make_checkpoint(name, root, tiny="--tiny" in sys.argv))
