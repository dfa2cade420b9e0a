"""Tiny DeepSeek-V3- and V2-style checkpoints in DeepSeek's block-FP8 layout, and their references.

Bases: transformers builds each model with the tests' random fp32 weights (tests/conftest.py's
save_random_model) at widths where 128x128 blocks make sense: hidden 256, 4 heads, kv_lora 128,
dense MLP 256, experts of 128 (8, top-2).
- "deepseek_v3": q through a LoRA of 128, rope 32 (kv_a_proj_with_mqa: 160 rows, 1.25 blocks: the
  partial last section of qkv_a_proj), a dense first layer, one shared expert, grouped sigmoid
  routing with a correction bias, YaRN.
- "deepseek_v2": q_proj (4 x (32 + 64) = 384 rows), rope 64 (kv_a: 192 rows, 1.5 blocks), every
  layer sparse, two shared experts (256), softmax routing.

`write_fp8` writes the published layout (DeepSeek-V3/R1's): every quantised linear's `weight` in
float8_e4m3fn plus `weight_scale_inv` float32 [ceil(out/128), ceil(in/128)] (amax / 448 per block:
tests/quant/fp8_checkpoints.py's per_block), routed experts per expert in the hub's names; the
router (`mlp.gate.weight`, `e_score_correction_bias`), embeddings, norms and lm_head as stored; the
config's quantization_config as DeepSeek-V3 ships it (no skip list). `dequantized_checkpoint`
(tests/quant/fp8_moe_checkpoints.py) is the same model in fp32 with the dequantised weights.

`reference` is transformers on that dequantised checkpoint with each linear that atomc runs as a
block-FP8 GEMM getting its input rounded through FP8 per 128-value group, as atomc quantises it
(`fp8_checkpoints.fake_quant`): not kv_b_proj (dense in atomc: its weight is read by the absorbed
attention), not the routed experts (weight-only in atomc; transformers 5 stacks them into
parameters no hook reaches), not the router or lm_head.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.conftest import VOCAB, build_tokenizer, save_random_model
from tests.quant import fp8_checkpoints as fc

BLOCK = 128
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
ATTENTION = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
QUANTISED = ATTENTION + MLP  # what DeepSeek's checkpoints store in FP8 (eh_proj: see write_fp8)
# the linears atomc runs as block-FP8 GEMMs (inputs fake-quantised in the reference)
GEMM_INPUTS = tuple(n for n in QUANTISED if n != "kv_b_proj")

COMMON = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=128, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip
FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_hidden_layers=2, q_lora_rank=128, qk_rope_head_dim=32, n_shared_experts=1, first_k_dense_replace=1,
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8,
            "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 128,
        },
    )),
    "deepseek_v2": ("DeepseekV2Config", dict(
        num_hidden_layers=2, q_lora_rank=None, qk_rope_head_dim=64, n_shared_experts=2, first_k_dense_replace=0,
        topk_method="greedy", routed_scaling_factor=1.5,
    )),
}  # fmt: skip


def base(family: str, out: Path, **extra) -> Path:
    """The fp32 tiny base of `family` (module docstring)."""
    cls, spec = FAMILIES[family]
    tok = build_tokenizer(out)
    cfg = getattr(transformers, cls)(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **COMMON, **{**spec, **extra}
    )
    return save_random_model(cfg, out)


def add_mtp_layer(base_dir: Path, seed: int = 11) -> Path:
    """An MTP layer (num_nextn_predict_layers 1) written into a V3 base: the last layer's tensors
    under the next layer's names with new random values, enorm / hnorm / eh_proj / shared_head.norm
    (tests/models/test_deepseek_mtp.py builds it the same way at its widths)."""
    state = load_file(str(base_dir / "model.safetensors"))
    cfg = json.loads((base_dir / "config.json").read_text())
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)

    def rand(shape, std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(shape, generator=g)

    mtp = f"model.layers.{n}."
    for name, t in sorted(state.items()):
        if name.startswith(f"model.layers.{n - 1}."):
            std, mean = (0.1, 1.0) if name.endswith("norm.weight") else (0.08, 0.0)
            state[mtp + name.split(".", 3)[3]] = rand(t.shape, 0.1 if name.endswith("_bias") else std, mean)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        state[f"{mtp}{norm}.weight"] = rand((hidden,), 0.1, 1.0)
    state[mtp + "eh_proj.weight"] = rand((hidden, 2 * hidden), 0.08)
    save_file(state, str(base_dir / "model.safetensors"), metadata={"format": "pt"})
    (base_dir / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}, indent=2))
    return base_dir


def quantised_names(state: dict, eh_proj: bool = False) -> list[str]:
    leaves = QUANTISED + (("eh_proj",) if eh_proj else ())
    return sorted(k.removesuffix(".weight") for k in state if k.endswith(".weight") and k.split(".")[-2] in leaves)


def write_fp8(base_dir: Path, out: Path, eh_proj: bool = False, qc: dict | None = None, block: int = BLOCK) -> Path:
    """`base_dir` in DeepSeek's block-FP8 layout under `out`. `eh_proj`: quantise the MTP layers'
    eh_proj too (DeepSeek-V3/R1 store it bf16; some re-quantised copies in FP8). `qc`: another
    quantization_config to write (bad-config tests)."""
    shutil.copytree(base_dir, out, dirs_exist_ok=True)
    state = load_file(str(base_dir / "model.safetensors"))
    tensors = dict(state)
    for name in quantised_names(state, eh_proj):
        q, s = fc.per_block(state[f"{name}.weight"].float(), block, block)
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = q, s
    return fc._write(out, tensors, qc or QUANTIZATION_CONFIG)


def online_reference_checkpoint(base_dir: Path, out: Path, shared_columns: int | None = None) -> Path:
    """`--quantization fp8`'s weights written as a plain fp32 checkpoint: every linear and routed
    expert projection quantised per row (amax / 448) and dequantised, except kv_b_proj (dense).
    `shared_columns`: the shared experts' down_proj rows quantised per block of that many columns
    (each shared expert's own rows, when the MoE op holds them: models/deepseek.py)."""
    shutil.copytree(base_dir, out, dirs_exist_ok=True)
    state = load_file(str(base_dir / "model.safetensors"))
    for name in quantised_names(state, eh_proj=True):
        if name.endswith("kv_b_proj"):
            continue
        w = state[f"{name}.weight"].float()
        if shared_columns and name.endswith("shared_experts.down_proj"):
            blocks = [fc.per_row(b) for b in w.split(shared_columns, dim=1)]
            state[f"{name}.weight"] = torch.cat([q.float() * s for q, s in blocks], dim=1).contiguous()
        else:
            q, s = fc.per_row(w)
            state[f"{name}.weight"] = (q.float() * s).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def reference(dequantized_dir: Path, fake_quant: bool = True, weight_only: str | None = None):
    """transformers (fp32) on the dequantised checkpoint; `fake_quant`: the block-FP8 GEMMs' inputs
    rounded through FP8 per 128-value group (module docstring), except under a module named
    `weight_only` (the shared experts when atomc runs them in the weight-only MoE op)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(dequantized_dir, dtype=torch.float32).eval()
    if fake_quant:
        hooked = [m for name, m in model.named_modules()
                  if name.split(".")[-1] in GEMM_INPUTS and weight_only not in name.split(".")]  # fmt: skip
        assert hooked and all(isinstance(m, torch.nn.Linear) for m in hooked)
        for m in hooked:
            m.register_forward_pre_hook(lambda mod, args: (fc.fake_quant(args[0], "group", group=BLOCK),))
    return model
