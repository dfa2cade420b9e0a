"""Tiny MoE checkpoints (Qwen3-MoE, Mixtral) with FP8 experts in each format's published layout, and
the references they are compared with.

Bases: transformers builds each model with random fp32 weights (std 0.08) and writes it in the hub
layout (per-expert `...experts.{i}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{i}.w1`).
The Qwen3-MoE base is 128 wide (4 query and 4 KV heads of 32) with 128-wide experts, so every
linear section and expert projection is whole 128x128
blocks (block FP8 as Qwen3-30B-A3B-FP8 and DeepSeek-V3 ship: activations of the linears are
quantised per 128-value group, so their input width must be whole groups).

Layouts, written here with tests/quant/fp8_checkpoints.py's quantisers (amax / 448):
- `hf-block`: `quant_method: fp8`, `weight_block_size` [128, 128]; every linear and expert
  projection `weight` e4m3 + `weight_scale_inv` per block; router and lm_head bf16/fp32.
- `hf-static` / `hf-dynamic`: `quant_method: fp8` per-tensor (Mixtral-FP8 style): one `weight_scale`
  per tensor, static `input_scale`s (calibrated for attention; for experts an arbitrary 0.01: atomc
  reads and drops them, the MoE being weight-only); `transformers_names` writes transformers'
  spellings (`weight_scale_inv`, `activation_scale`).
- `ct-FP8_DYNAMIC` / `ct-FP8`: compressed-tensors' layout (`weight_scale` [N, 1] per channel, or [1]
  per tensor with a static `input_scale`), its config from the compressed-tensors library's own
  preset; the library's compressor is not used: under transformers 5 the experts are one stacked
  parameter, not Linear modules, so it would not reach them; the tensors it writes are these.
- `quark-ptpc`: Quark per_channel weights ([N] scales), dynamic per-token inputs.

`reference` is transformers running the dequantised checkpoint (written as a plain fp32 one, which
transformers stacks into its experts) with each non-expert linear's input rounded through FP8 as the
scheme does (`fake_quant_inputs`: transformers 5's experts are no Linear modules, so no hook reaches
them, which is what weight-only experts are).
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

EXPERT_INPUT_SCALE = 0.01  # what the static writers put as experts' input scales (ignored by atomc)
MOE_LINEARS = fc.LINEARS + ("w1", "w2", "w3")  # Mixtral's expert projections


def base(family: str, out: Path) -> Path:
    """The fp32 tiny base: "qwen3_moe" (128 wide, 4 experts of 128, top-2) or "mixtral" (64 wide,
    4 experts of 64, top-2); 2 layers, every MLP sparse."""
    tok = build_tokenizer(out)
    common = dict(
        vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False, num_experts_per_tok=2,
    )  # fmt: skip
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            hidden_size=128, head_dim=32, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=128,
            num_experts=4, norm_topk_prob=True, **common,
        )  # fmt: skip
    else:
        cfg = transformers.MixtralConfig(
            hidden_size=64,
            num_key_value_heads=2,
            intermediate_size=64,
            num_local_experts=4,
            sliding_window=None,
            **common,
        )
    return save_random_model(cfg, out)


def quant_linears(state: dict) -> list[str]:
    """Linears and expert projections a checkpoint quantises (not the router, not lm_head)."""
    return sorted(k.removesuffix(".weight") for k in state if k.endswith(".weight") and k.split(".")[-2] in MOE_LINEARS)


def is_expert(name: str) -> bool:
    return ".experts." in name


def _ct_config(preset: str) -> dict:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    qc = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
        ignore=["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"],
        format="float-quantized",
    ).model_dump()
    qc["quantization_status"] = "compressed"
    return qc


def write(base_dir: Path, out: Path, fmt: str, transformers_names: bool = False) -> Path:
    """`base_dir` quantised into layout `fmt` (module docstring) under `out`."""
    shutil.copytree(base_dir, out, dirs_exist_ok=True)
    state = load_file(str(base_dir / "model.safetensors"))
    static = fmt in ("hf-static", "ct-FP8")
    amax = fc.calibrate(base_dir) if static else {}  # the attention linears' inputs (hooks reach no expert)
    tensors = dict(state)
    ws, is_ = ("weight_scale_inv", "activation_scale") if transformers_names else ("weight_scale", "input_scale")
    for name in quant_linears(state):
        w = state[f"{name}.weight"].float()
        if fmt == "hf-block":
            q, s = fc.per_block(w, 128, 128)
            tensors[f"{name}.weight_scale_inv"] = s
        elif fmt in ("ct-FP8_DYNAMIC", "quark-ptpc"):
            q, s = fc.per_row(w)
            tensors[f"{name}.weight_scale"] = s if fmt.startswith("ct") else s.reshape(-1)
        else:  # per-tensor
            q, s = fc.per_tensor(w)
            tensors[f"{name}.{ws if fmt.startswith('hf') else 'weight_scale'}"] = s.reshape(1) if fmt == "ct-FP8" else s
            if static:
                x = EXPERT_INPUT_SCALE if is_expert(name) else amax[name] / fc.FP8_MAX
                scale = torch.tensor(x) if fmt.startswith("hf") else torch.tensor([x])
                tensors[f"{name}.{is_ if fmt.startswith('hf') else 'input_scale'}"] = scale
        tensors[f"{name}.weight"] = q
    if fmt.startswith("hf"):
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static" if static else "dynamic",
              "modules_to_not_convert": ["lm_head"]}  # fmt: skip
        if fmt == "hf-block":
            qc["weight_block_size"] = [128, 128]
    elif fmt.startswith("ct"):
        qc = _ct_config(fmt.removeprefix("ct-"))
    elif fmt == "quark-ptpc":
        qc = fc.quark_config("per_channel", "per_channel", True)
    else:
        raise ValueError(fmt)
    return fc._write(out, tensors, qc)


def dequantized_checkpoint(base_dir: Path, qdir: Path, out: Path) -> Path:
    """A plain fp32 checkpoint of `base_dir` holding the quantised checkpoint's dequantised weights."""
    shutil.copytree(base_dir, out, dirs_exist_ok=True)
    state = load_file(str(base_dir / "model.safetensors"))
    for name, w in fc.dequantized_weights(qdir).items():
        state[f"{name}.weight"] = w.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def online_reference_checkpoint(base_dir: Path, out: Path) -> Path:
    """`--quantization fp8`'s weights: every linear and expert projection quantised per row."""
    shutil.copytree(base_dir, out, dirs_exist_ok=True)
    state = load_file(str(base_dir / "model.safetensors"))
    for name in quant_linears(state):
        q, s = fc.per_row(state[f"{name}.weight"].float())
        state[f"{name}.weight"] = (q.float() * s).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def reference(dequantized_dir: Path, activation: str | None, static_scales: dict | None = None):
    """transformers on `dequantized_dir`, each non-expert linear's input fake-quantised (`activation`
    as fc.fake_quant does; None: not at all)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(dequantized_dir, dtype=torch.float32).eval()
    hooked = [n for n, _ in model.named_modules() if n.split(".")[-1] in fc.LINEARS]
    assert hooked and not any(is_expert(n) for n in hooked), hooked  # experts stay weight-only
    return fc.fake_quant_inputs(model, activation, static_scales) if activation else model


def config(qdir: Path) -> dict:
    return json.loads((qdir / "config.json").read_text())
