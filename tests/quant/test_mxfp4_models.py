"""GPT-OSS with MXFP4 experts (tests/quant/mxfp4_checkpoints.py) on the CPU reference path: the
format's value table and nibble order, the checkpoint's tensors landing in FusedMoE's rows, the
same greedy tokens and logits as the dequantised model (atomc and transformers), and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open

from atomc import LLM, SamplingParams
from atomc.ops.moe_quant import E2M1_VALUES, dequantize_mxfp4
from models.loader import load_model
from models.quant.mxfp4 import quantize_mxfp4
from models.quant.spec import QuantConfigError, parse_quantization_config
from tests.greedy import assert_greedy_agree, model_logits
from tests.quant import mxfp4_checkpoints as mc

PROMPT = [5, 17, 33, 2, 99, 150, 7, 8, 61, 3, 200, 11]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return mc.build(tmp_path_factory.mktemp("mxfp4"))


def test_dequantize_reads_low_nibble_first_and_e8m0_exponents():
    """Byte 0x21 holds codes 1 (first value: 0.5) and 2 (second: 1.0); 0xF8 holds -0.0 then -6.0;
    scale 128 doubles, 126 halves."""
    blocks = torch.tensor([[0x21] + [0] * 15, [0xF8] + [0] * 15], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, torch.tensor([[128], [126]], dtype=torch.uint8))
    assert out[0, :2].tolist() == [1.0, 2.0] and out[1, :2].tolist() == [-0.0, -3.0]
    codes = torch.arange(16, dtype=torch.uint8)  # one 32-value group: code c in both nibbles of byte c
    every = dequantize_mxfp4((codes | (codes << 4))[None], torch.tensor([[127]], dtype=torch.uint8))
    assert every[0, 0::2].tolist() == every[0, 1::2].tolist() == list(E2M1_VALUES)


def test_quantiser_round_trips_and_bounds_the_error():
    w = torch.randn(4, 6, 128, generator=torch.Generator().manual_seed(0))
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (4, 6, 64) and scales.shape == (4, 6, 4) and blocks.dtype == scales.dtype == torch.uint8
    d = dequantize_mxfp4(blocks, scales)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(d)), d)  # representable values stay put
    # round to nearest: at most half of e2m1's widest step (2) times the group's scale (< amax / 3)
    group_max = w.unflatten(-1, (4, 32)).abs().amax(-1, keepdim=True)
    assert ((d - w).unflatten(-1, (4, 32)).abs() <= group_max / 3 + 1e-6).all()
    assert (d - w).abs().mean() < 0.15 * w.abs().mean()  # e2m1 is coarse: about 12% on Gaussian weights


def test_config_parses_and_skips_modules():
    spec = parse_quantization_config(mc.MXFP4_CONFIG)
    assert spec.method == "mxfp4" and spec.experts == "mxfp4" and spec.default is None
    assert spec.experts_format_for("model.layers.3.mlp.experts") == "mxfp4"
    assert spec.scheme_for("model.layers.3.self_attn.q_proj") is None  # linears stay as stored
    skipped = parse_quantization_config({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.1.mlp"]})
    assert skipped.experts_format_for("model.layers.1.mlp.experts") is None
    assert skipped.experts_format_for("model.layers.11.mlp.experts") == "mxfp4"
    with pytest.raises(QuantConfigError, match="modules_to_not_convert"):
        parse_quantization_config({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"})


def test_checkpoint_tensors_land_in_fused_rows(ckpts):
    """gate_up_proj_blocks [E, 2I, H/32, 16] rows interleaved (gate even, up odd) -> w13_blocks
    [E, 2I, H/2] gate rows then up rows; down_proj_* flattened; element by element."""
    _, mx = ckpts
    model = load_model(mx, torch.float32, "cpu")
    experts = model.model.layers[2].mlp.experts
    assert experts.w13_weight is None and experts.w13_blocks.dtype == torch.uint8
    prefix = "model.layers.2.mlp.experts"
    with safe_open(str(mx / "model.safetensors"), "pt") as f:
        names = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
        gu_b, gu_s, dn_b, dn_s = (f.get_tensor(f"{prefix}.{n}") for n in names)
    i = experts.intermediate_size
    for e in (0, 5):
        for j in (0, 1, i - 1):
            assert torch.equal(experts.w13_blocks[e, j], gu_b[e, 2 * j].flatten())
            assert torch.equal(experts.w13_blocks[e, i + j], gu_b[e, 2 * j + 1].flatten())
            assert torch.equal(experts.w13_scales[e, i + j], gu_s[e, 2 * j + 1])
        assert torch.equal(experts.w2_blocks[e], dn_b[e].flatten(1)) and torch.equal(experts.w2_scales[e], dn_s[e])


def test_logits_and_greedy_match_the_dequantised_model(ckpts):
    """The MXFP4 model against the same model with dequantised fp32 experts: atomc's dense path and
    transformers. The weights are the same values, so only summation order differs (fp32: ~1e-5)."""
    dense, mx = ckpts
    ids = torch.tensor(PROMPT * 3)
    quant, plain = load_model(mx, torch.float32, "cpu"), load_model(dense, torch.float32, "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    got = model_logits(quant)(ids.tolist())
    assert (got - model_logits(plain)(ids.tolist())).abs().max() < 1e-4
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        want = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=32, min_new_tokens=32)
    assert (got - ref).abs().max() < 1e-3
    llm = LLM(model=str(mx), dtype="float32", device="cpu", enforce_eager=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))

    def hf_logits(seq):
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0]

    assert_greedy_agree(out[0].outputs[0].token_ids, want[0, len(PROMPT) :].tolist(), PROMPT, hf_logits)


def test_skipped_experts_load_dense(ckpts, tmp_path):
    """modules_to_not_convert naming a layer's MLP keeps its experts dense (bf16 tensors expected)."""
    dense, mx = ckpts
    for f in dense.iterdir():
        shutil.copy(f, tmp_path / f.name)
    raw = json.loads((dense / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = load_model(tmp_path, torch.float32, "cpu")
    assert model.model.layers[0].mlp.experts.moe_method is None
    assert model.model.layers[0].mlp.experts.w13_weight is not None


def test_bad_mxfp4_configs_are_clear_errors(ckpts, tmp_path):
    _, mx = ckpts
    raw = json.loads((mx / "config.json").read_text())
    raw["intermediate_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(QuantConfigError, match=r"intermediate size on this rank \(48\) is not a multiple of the 32"):
        load_model(tmp_path, torch.float32, "cpu", load_format="dummy")
    raw["intermediate_size"] = 64
    raw["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="'fp8' is not supported"):
        load_model(tmp_path, torch.float32, "cpu", load_format="dummy")


def test_the_mxfp4_method_enters_the_compile_cache_key(ckpts):
    """Its apply is traced (atomc::moe_quant), so its file is hashed into an MXFP4 model's key."""
    from atomc.graphs import build
    from models.arch import ModelArch
    from models.loader.safetensors import build_on_meta

    dense, mx = ckpts
    assert "models.quant.mxfp4" in build.model_modules(build_on_meta(ModelArch.from_dir(mx), torch.float32))
    assert "models.quant.mxfp4" not in build.model_modules(build_on_meta(ModelArch.from_dir(dense), torch.float32))


def test_dummy_weights_fill_mxfp4_experts(ckpts):
    """Benchmarks load random weights: MXFP4 experts get random codes and small finite scales."""
    _, mx = ckpts
    model = load_model(mx, torch.float32, "cpu", load_format="dummy")
    experts = model.model.layers[0].mlp.experts
    w = dequantize_mxfp4(experts.w13_blocks, experts.w13_scales)
    assert torch.isfinite(w).all() and 0.005 < w.abs().mean() < 0.05
    out = model_logits(model)(PROMPT)
    assert torch.isfinite(out).all()


def test_traced_graph_keeps_one_moe_quant_node_a_layer_in_the_report(ckpts):
    """Dynamo traces the MXFP4 model whole; the CPU passes keep atomc::moe_quant (4 layers), and the
    compile report counts its FLOPs at the unpacked widths (H 64, I 64, top-2) and names the format."""
    from atomc.graphs.report import format_report
    from tests.graphs.test_report import manifest, traced_flops

    _, mx = ckpts
    _, after = traced_flops(mx)
    nodes = after["moe_nodes"]
    assert len(nodes) == 4 and all(n["op"] == "atomc::moe_quant" and n["weight_format"] == "mxfp4" for n in nodes)
    assert {(n["experts"], n["top_k"], n["hidden"], n["intermediate"]) for n in nodes} == {(6, 2, 64, 64)}
    assert all(n["flops_per_token"] == 2 * 2 * (2 * 64 * 64 + 64 * 64) for n in nodes)
    assert "hidden 64, intermediate 64, mxfp4 experts" in format_report(manifest(after))


def test_compiled_equals_eager(ckpts, tmp_path):
    """One artifact build (a minute or two on 2 cores): the MXFP4 model through trace, passes,
    Inductor and the saved artifact (its pickle scan included) gives the eager run's tokens."""
    _, mx = ckpts
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = []
    for eager in (True, False):
        llm = LLM(model=str(mx), dtype="float32", device="cpu", enforce_eager=eager, cache_dir=str(tmp_path))
        runs.append(llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids)
    assert runs[0] == runs[1]
