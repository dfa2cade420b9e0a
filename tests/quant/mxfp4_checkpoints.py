"""A tiny GPT-OSS in both of its on-disk forms: MXFP4 experts (as openai/gpt-oss-* ship) and the same
model with those experts dequantised (a plain fp32 checkpoint transformers reads).

The model is tests/conftest.py's GPT-OSS (4 layers, sinks, windows, YaRN, 6 experts top-2 with
biases) with I = 64, so both expert input dims (H 64, I 64) are whole 32-value scale groups. Its
random fp32 experts are quantised by models/quant/mxfp4.py's round-to-nearest quantiser; the
dequantised checkpoint then holds exactly the values the MXFP4 one encodes, so the two must run
the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from atomc.ops.moe_quant import dequantize_mxfp4
from models.quant.mxfp4 import quantize_mxfp4
from tests.conftest import FAMILIES, VOCAB, build_tokenizer

GROUP = 32
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    # what openai/gpt-oss-20b's config.json lists
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def build(out: Path, intermediate: int = 64) -> tuple[Path, Path]:
    """(dequantised fp32 checkpoint dir, MXFP4 checkpoint dir) under `out`."""
    dense, mx = out / "dense", out / "mxfp4"
    spec = {k: v for k, v in FAMILIES["gpt_oss"].items() if k != "cls"}
    spec["intermediate_size"] = intermediate
    tok = build_tokenizer(dense)
    build_tokenizer(mx)
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **spec,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    packed = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith("sinks"):
                p.normal_(0.5, 1.0)
            elif name.endswith("_bias") or ".router." in name:
                p.normal_(0, 0.05)
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                w = getattr(experts, proj)  # transformers' x @ W layout: [E, in, out]
                blocks, scales = quantize_mxfp4(w.transpose(1, 2))  # [E, out, in/2], [E, out, in/32]
                w.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
                e, rows = blocks.shape[:2]
                prefix = f"model.layers.{i}.mlp.experts.{proj}"
                packed[f"{prefix}_blocks"] = blocks.reshape(e, rows, -1, GROUP // 2).contiguous()
                packed[f"{prefix}_scales"] = scales.contiguous()
    model.save_pretrained(dense)
    tensors = load_file(str(dense / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            del tensors[name]
    tensors.update(packed)
    save_file(tensors, str(mx / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((dense / "config.json").read_text())
    raw["quantization_config"] = MXFP4_CONFIG
    (mx / "config.json").write_text(json.dumps(raw, indent=2))
    return dense, mx
