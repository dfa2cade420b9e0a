"""Tiny Llama checkpoints quantised into each FP8 format's published on-disk layout, and references.

One unquantised tiny Llama (tests/conftest.py's builder, random weights) is quantised here:
- compressed-tensors (FP8 static per-tensor, FP8_DYNAMIC, FP8_BLOCK) by the compressed-tensors
  library itself: its scheme presets, its compressor, its config writer;
- HF/vLLM `quant_method: fp8` (per-tensor; block 128x128 as DeepSeek-V3 / Qwen3-FP8 ship) and AMD
  Quark (written by hand: Quark's package is not installed) to their documented layouts.

Static activation scales are calibrated on a few prompts (amax / 448 of each linear's input).
`dequantized_reference` is transformers running the unquantised model with each quantised linear's
weight replaced by its dequantised checkpoint value; `fake_quant_inputs` additionally rounds each
such linear's input through FP8 the way the scheme does (the activation error atomc's run has).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.conftest import build_checkpoint, save_random_model

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CALIBRATION = [[5, 17, 33, 2, 99, 150, 7, 8, 61, 3], [200, 11, 42, 42, 9, 300, 1, 77]]


def base_checkpoint(out: Path, wide: bool = False) -> Path:
    """The unquantised tiny Llama (fp32). `wide`: hidden 128, 4 KV heads of 32, MLP 256, so every
    q/k/v and gate/up section is a whole number of 128x128 blocks (block FP8 as DeepSeek ships)."""
    if not wide:
        return build_checkpoint("llama", out)
    from tests.conftest import VOCAB, build_tokenizer

    tok = build_tokenizer(out)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    return save_random_model(cfg, out)


def quant_linears(state: dict) -> list[str]:
    """Names (without .weight) of the linears a quantised checkpoint quantises (not lm_head)."""
    return sorted(k.removesuffix(".weight") for k in state if k.endswith(".weight") and k.split(".")[-2] in LINEARS)


def calibrate(model_dir: Path) -> dict[str, float]:
    """{linear name: amax of its input} over CALIBRATION, from transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for name, m in model.named_modules():
        if name.split(".")[-1] in LINEARS:

            def hook(mod, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

            hooks.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        for ids in CALIBRATION:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return amax


def _copy_base(base: Path, out: Path) -> None:
    shutil.copytree(base, out, dirs_exist_ok=True)
    for f in out.glob("*.safetensors"):
        f.unlink()


def _write(out: Path, tensors: dict, qc: dict) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def per_tensor(w: torch.Tensor):
    s = (w.abs().max() / FP8_MAX).clamp(min=1e-12)
    return (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s.reshape(())


def per_row(w: torch.Tensor):
    s = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def per_block(w: torch.Tensor, bn: int, bk: int):
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:n, :k] = w
    tiles = padded.view(nb, bn, kb, bk)
    s = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(nb * bn, kb * bk)[:n, :k]
    return q, s


def write_hf_fp8(base: Path, out: Path, scheme: str, transformers_names: bool = False, block: int = 128) -> Path:
    """HF/vLLM `quant_method: fp8`. scheme: "block" (weight_block_size [128, 128], weight_scale_inv),
    "static" or "dynamic" (per-tensor; vLLM's weight_scale / input_scale, or with
    `transformers_names` transformers' weight_scale_inv / activation_scale)."""
    _copy_base(base, out)
    state = load_file(str(base / "model.safetensors"))
    amax = calibrate(base) if scheme == "static" else {}
    tensors = dict(state)
    ws_name, is_name = (
        ("weight_scale_inv", "activation_scale") if transformers_names else ("weight_scale", "input_scale")
    )
    for name in quant_linears(state):
        w = state[f"{name}.weight"].float()
        if scheme == "block":
            q, s = per_block(w, block, block)
            tensors[f"{name}.weight_scale_inv"] = s
        else:
            q, s = per_tensor(w)
            tensors[f"{name}.{ws_name}"] = s
            if scheme == "static":
                tensors[f"{name}.{is_name}"] = torch.tensor(amax[name] / FP8_MAX)
        tensors[f"{name}.weight"] = q
    qc = {"quant_method": "fp8", "activation_scheme": "static" if scheme == "static" else "dynamic", "fmt": "e4m3"}
    if scheme == "block":
        qc["weight_block_size"] = [block, block]
    qc["modules_to_not_convert"] = ["lm_head"]
    return _write(out, tensors, qc)


QUARK_FP8 = {"dtype": "fp8_e4m3", "symmetric": True, "round_method": "half_even", "scale_type": "float"}


def quark_config(weight_qscheme: str, input_qscheme: str, dynamic: bool) -> dict:
    """Quark's config.json layout for FP8 (global config, exclude, export block)."""
    w = {
        **QUARK_FP8,
        "qscheme": weight_qscheme,
        "is_dynamic": False,
        "ch_axis": 0 if weight_qscheme == "per_channel" else None,
    }
    a = {
        **QUARK_FP8,
        "qscheme": input_qscheme,
        "is_dynamic": dynamic,
        "ch_axis": -1 if input_qscheme == "per_channel" else None,
    }
    return {
        "quant_method": "quark",
        "quant_mode": "eager_mode",
        "global_quant_config": {"weight": w, "input_tensors": a, "output_tensors": None, "bias": None},
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "exclude": ["lm_head"],
        "export": {"kv_cache_group": [], "pack_method": "reorder", "weight_format": "real_quantized"},
        "algo_config": None,
    }


def write_quark(base: Path, out: Path, scheme: str) -> Path:
    """scheme "ptpc": per_channel weights ([N] scales), dynamic per_channel (per-token) inputs;
    "static": per_tensor weights and static per_tensor inputs (scalar weight_scale, input_scale)."""
    _copy_base(base, out)
    state = load_file(str(base / "model.safetensors"))
    amax = calibrate(base) if scheme == "static" else {}
    tensors = dict(state)
    for name in quant_linears(state):
        w = state[f"{name}.weight"].float()
        if scheme == "ptpc":
            q, s = per_row(w)
            tensors[f"{name}.weight_scale"] = s.reshape(-1)
        else:
            q, s = per_tensor(w)
            tensors[f"{name}.weight_scale"] = s
            tensors[f"{name}.input_scale"] = torch.tensor(amax[name] / FP8_MAX)
        tensors[f"{name}.weight"] = q
    qc = (
        quark_config("per_channel", "per_channel", True)
        if scheme == "ptpc"
        else quark_config("per_tensor", "per_tensor", False)
    )
    return _write(out, tensors, qc)


def write_compressed_tensors(base: Path, out: Path, preset: str, ignore=("lm_head",)) -> Path:
    """llmcompressor's layout, written by the compressed-tensors library: preset FP8 (static
    per-tensor, calibrated input scales), FP8_DYNAMIC or FP8_BLOCK; lm_head ignored."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=list(ignore)
    )
    apply_quantization_config(model, config, show_progress=False)
    amax = calibrate(base) if preset == "FP8" else {}
    with torch.no_grad():
        for name, m in model.named_modules():
            scheme = getattr(m, "quantization_scheme", None)
            if scheme is None:
                continue
            w = m.weight.float()
            args = scheme.weights
            if args.strategy == "tensor":
                lo, hi = w.min().reshape(1), w.max().reshape(1)
            elif args.strategy == "channel":
                lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
            else:
                bn, bk = args.block_structure
                lo = -per_block(w, bn, bk)[1] * FP8_MAX
                hi = -lo
            scale, _ = calculate_qparams(lo, hi, args)
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
            if hasattr(m, "input_scale"):
                a = torch.tensor([amax[name]])
                m.input_scale.copy_(calculate_qparams(-a, a, scheme.input_activations)[0].reshape(m.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for f in base.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    for f in ("special_tokens_map.json", "generation_config.json"):
        if (base / f).exists():
            shutil.copy(base / f, out / f)
    return out


# ---- references ----


def dequantized_weights(qdir: Path, block: int = 128) -> dict[str, torch.Tensor]:
    """{linear name: fp32 weight} of every quantised linear in a checkpoint, dequantised."""
    state = load_file(str(qdir / "model.safetensors"))
    out = {}
    for key, w in state.items():
        if not key.endswith(".weight") or w.dtype != FP8:
            continue
        name = key.removesuffix(".weight")
        scale = next(state[f"{name}.{s}"] for s in ("weight_scale_inv", "weight_scale") if f"{name}.{s}" in state)
        w = w.float()
        s = scale.float()
        if s.dim() == 2 and s.shape[0] != w.shape[0]:  # blocks of block x block
            out[name] = w * s.repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)[:, : w.shape[1]]
        else:
            out[name] = w * s.reshape(-1, 1) if s.numel() > 1 else w * s.reshape(())
    return out


def input_scales(qdir: Path) -> dict[str, float]:
    state = load_file(str(qdir / "model.safetensors"))
    return {
        k.rsplit(".", 1)[0]: float(v) for k, v in state.items() if k.endswith((".input_scale", ".activation_scale"))
    }


def dequantized_reference(base: Path, qdir: Path):
    """transformers' model of `base` with the checkpoint's dequantised linear weights."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    weights = dequantized_weights(qdir)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in weights.items():
            params[f"{name}.weight"].copy_(w)
    return model


def fake_quant(x: torch.Tensor, activation: str, static_scale: float | None = None, group: int = 128):
    """x rounded through FP8 the way a scheme's activation quant does (quantise, dequantise)."""
    if activation == "static":
        s = torch.tensor(static_scale)
    elif activation == "tensor":
        s = (x.abs().max() / FP8_MAX).clamp(min=1e-12)
    elif activation == "token":
        s = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    else:
        g = x.unflatten(-1, (x.shape[-1] // group, group))
        s = (g.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return ((g / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s).flatten(-2)
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s


def fake_quant_inputs(model, activation: str, static_scales: dict[str, float] | None = None):
    """Round each quantised linear's input through FP8 (forward pre-hooks on the HF model); for
    static scales, the max over the linears sharing an input (as atomc's merged layers use)."""
    static_scales = static_scales or {}
    for name, m in model.named_modules():
        leaf = name.split(".")[-1]
        if leaf not in LINEARS:
            continue
        scale = None
        if activation == "static":
            group = (
                ("q_proj", "k_proj", "v_proj")
                if leaf in ("q_proj", "k_proj", "v_proj")
                else (("gate_proj", "up_proj") if leaf in ("gate_proj", "up_proj") else (leaf,))
            )
            head = name.rsplit(".", 1)[0]
            scale = max(static_scales[f"{head}.{g}"] for g in group)
        m.register_forward_pre_hook(lambda mod, args, scale=scale: (fake_quant(args[0], activation, scale),))
    return model
