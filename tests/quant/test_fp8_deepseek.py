"""DeepSeek-V3/R1's block-FP8 checkpoints (models/deepseek.py) on the CPU, fp32 activations: tiny V3-
and V2-style models in the published layout (tests/quant/fp8_deepseek_checkpoints.py) against
transformers on the dequantised weights; which linears are FP8, which stay dense; kv_b_proj
dequantised into the model dtype; the MTP layer; online `--quantization fp8`; the CPU passes on the
FP8 graph; refused configs.

Tolerances, against transformers with the dequantised weights and every block-FP8 GEMM's input
rounded through FP8 per 128-value group as atomc does (`reference`): the two compute the same thing
(measured: most tokens within 5e-6), so at least 60% of the prompt's tokens must agree within 1e-3.
The others may move further, bounded by OUTLIER_ATOL (0.25 on logits of magnitude ~5): a value on
an FP8 rounding boundary that rounds the other way on a CPU summing in another order (one e4m3 step
is 2^-3 of a value, through 256-wide layers of 0.08-std weights a few 1e-2 in a logit), or a router
near-tie that then picks another expert, and attention carries such a token's change to later
ones. Measured: up to 0.035 on 1-2 of 37 tokens with an earlier transformers; 0.01-0.07 on 9 of 37
(V3) with transformers 5.24 on another CPU, while atomc and transformers on the dequantised
weights, unquantised, agreed exactly. A wrong scale or a missing activation quant moves every token
by 0.1-1 (the plain comparison below: 0% of the tokens within 1e-3), so the 60% rule still catches
it. Against the dequantised weights alone (plain fp32 activations) the median token's max |diff|
stays under 15% of the largest logit (measured 8-9%); the largest is not bounded there: the
activation rounding flips some tokens' experts (measured up to 57%).

Greedy: 32 tokens against the reference's generate, parting only at a near-tie: margin GREEDY_MARGIN
(0.1), above the measured outliers (0.035) that a rounding flip can move a logit by.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from atomc import LLM, SamplingParams
from models import deepseek
from models.arch import ModelArch
from models.deepseek import DeepseekRouter
from models.layers.linear import LinearBase
from models.loader import load_model
from models.loader.safetensors import build_on_meta
from models.quant.fp8 import DequantizedFP8BlockLinearMethod, FP8BlockLinearMethod, OnlineFP8LinearMethod
from models.quant.fp8_moe import Fp8MoEMethod
from models.quant.spec import QuantConfigError
from models.quant.unquantized import UnquantizedLinearMethod
from tests.greedy import assert_greedy_agree
from tests.quant import fp8_checkpoints as fc
from tests.quant import fp8_deepseek_checkpoints as dc
from tests.quant import fp8_moe_checkpoints as mc

BULK_ATOL, BULK_SHARE, OUTLIER_ATOL, PLAIN_MEDIAN_REL = 1e-3, 0.6, 0.25, 0.15
GREEDY_MARGIN = 0.1
PROMPT = [5, 17, 33, 2, 99, 150, 7, 8]
FAMILIES = list(dc.FAMILIES)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family (or "deepseek_v3-mtp", "deepseek_v3-mtp-eh") -> (base, FP8 dir, dequantised dir)."""
    root, cache = tmp_path_factory.mktemp("dsfp8"), {}

    def get(case: str):
        if case not in cache:
            family = case.split("-")[0]
            b = dc.base(family, root / case)
            if "mtp" in case:
                dc.add_mtp_layer(b)
            q = dc.write_fp8(b, root / f"{case}-fp8", eh_proj=case.endswith("-eh"))
            cache[case] = (b, q, mc.dequantized_checkpoint(b, q, root / f"{case}-deq"))
        return cache[case]

    return get


def _logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.numel())))


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    """The module docstring's rule: 60% of the tokens within BULK_ATOL, all within OUTLIER_ATOL."""
    per_token = (got - want).abs().amax(-1)
    share = (per_token <= BULK_ATOL).float().mean().item()
    assert share >= BULK_SHARE and per_token.max().item() <= OUTLIER_ATOL, per_token.tolist()


def _weight_only_shared() -> str | None:
    """The module the reference leaves unrounded: the shared experts when the MoE op holds them
    (models/deepseek.py FUSE_SHARED_EXPERTS), which runs its experts weight-only."""
    return "shared_experts" if deepseek.FUSE_SHARED_EXPERTS else None


def _methods(model) -> dict[str, type]:
    return {n: type(m.linear_method) for n, m in model.named_modules() if isinstance(m, LinearBase)}


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_linears_experts_and_dense_modules_load_as_the_checkpoint_stores_them(family, made):
    _, qdir, _ = made(family)
    model = load_model(qdir, torch.float32, "cpu")
    state = load_file(str(qdir / "model.safetensors"))
    want = fc.dequantized_weights(qdir)
    for name, method in _methods(model).items():
        leaf = name.split(".")[-1]
        if leaf == "gate":  # the router: stored dense, loaded dense (fp32 correction bias)
            assert method is UnquantizedLinearMethod
        elif leaf == "kv_b_proj":
            assert method is DequantizedFP8BlockLinearMethod
        else:  # qkv_a_proj, q_b_proj, o_proj, the dense MLP's and the shared experts' gate_up / down
            assert method is FP8BlockLinearMethod, name
    for i, layer in enumerate(model.model.layers):
        pre, attn = f"model.layers.{i}.", layer.self_attn
        # kv_b_proj: the dequantised checkpoint weight in the activation dtype, no scales left
        assert attn.kv_b_proj.weight.dtype == torch.float32 and not hasattr(attn.kv_b_proj, "weight_scale_inv")
        assert torch.equal(attn.kv_b_proj.weight, want[pre + "self_attn.kv_b_proj"])
        q = "q_a_proj" if family == "deepseek_v3" else "q_proj"
        qkv_a = torch.cat([state[f"{pre}self_attn.{q}.weight"], state[f"{pre}self_attn.kv_a_proj_with_mqa.weight"]])
        assert torch.equal(attn.qkv_a_proj.weight.view(torch.uint8), qkv_a.view(torch.uint8))
        assert attn.kv_a_layernorm.weight.dtype == torch.float32
        mlp = layer.mlp
        if isinstance(mlp.gate if hasattr(mlp, "gate") else None, DeepseekRouter):
            assert torch.equal(mlp.gate.weight, state[pre + "mlp.gate.weight"])
            bias = mlp.gate.e_score_correction_bias
            assert (bias is not None) == (family == "deepseek_v3") and (bias is None or bias.dtype == torch.float32)
            assert isinstance(mlp.experts.moe_method, Fp8MoEMethod)
            assert mlp.experts.moe_method.weight_format == "fp8_block"
            assert mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_transformers_on_the_dequantised_weights(family, made):
    _, qdir, deq = made(family)
    model = load_model(qdir, torch.float32, "cpu")
    ids = torch.randint(0, 384, (37,), generator=torch.Generator().manual_seed(1))
    got = _logits(model, ids)
    with torch.no_grad():
        fake = dc.reference(deq, weight_only=_weight_only_shared())(ids[None]).logits[0]
        plain = dc.reference(deq, fake_quant=False)(ids[None]).logits[0]
    assert_close_to_reference(got, fake)
    rel = ((got - plain).abs().amax(-1) / plain.abs().max()).median().item()
    assert rel < PLAIN_MEDIAN_REL, rel


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_experts_inside_the_moe_op_keep_the_checkpoints_bytes(family, made, monkeypatch):
    """FUSE_SHARED_EXPERTS: the shared MLP's e4m3 bytes and block scales load into the FP8 experts
    after the routed ones, cut into experts of the routed width, and run there weight-only (as the
    routed experts do): against the reference that rounds every other block-FP8 GEMM's input."""
    from models import deepseek

    monkeypatch.setattr(deepseek, "FUSE_SHARED_EXPERTS", True)
    _, qdir, deq = made(family)
    model = load_model(qdir, torch.float32, "cpu")
    state = load_file(str(qdir / "model.safetensors"))
    c = model.config
    e, inter = c.moe.num_experts, c.moe.intermediate_size
    last = len(model.model.layers) - 1
    experts = model.model.layers[last].mlp.experts
    pre = f"model.layers.{last}.mlp.shared_experts."
    for j in range(c.shared_intermediate_size // inter):
        rows, blocks = slice(j * inter, (j + 1) * inter), slice(j * inter // 128, (j + 1) * inter // 128)
        w13 = torch.cat([state[pre + "gate_proj.weight"][rows], state[pre + "up_proj.weight"][rows]])
        s13 = torch.cat([state[f"{pre}{p}_proj.weight_scale_inv"][blocks] for p in ("gate", "up")])
        w2 = state[pre + "down_proj.weight"][:, rows]
        assert torch.equal(experts.w13_weight[e + j].view(torch.uint8), w13.view(torch.uint8))
        assert torch.equal(experts.w13_weight_scale[e + j], s13)
        assert torch.equal(experts.w2_weight[e + j].view(torch.uint8), w2.view(torch.uint8))
        assert torch.equal(experts.w2_weight_scale[e + j], state[pre + "down_proj.weight_scale_inv"][:, blocks])
    ids = torch.randint(0, 384, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = dc.reference(deq, weight_only="shared_experts")(ids[None]).logits[0]
    assert_close_to_reference(_logits(model, ids), want)


def _greedy_against_reference(llm: LLM, deq) -> None:
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    ref = dc.reference(deq)
    with torch.no_grad():
        want = ref.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=32, min_new_tokens=32)

    def ref_logits(seq):
        with torch.no_grad():
            return ref(torch.tensor([seq])).logits[0]

    got = out[0].outputs[0].token_ids
    assert len(got) == 32
    assert_greedy_agree(got, want[0, len(PROMPT) :].tolist(), PROMPT, ref_logits, margin=GREEDY_MARGIN)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_32_tokens_agree_with_transformers_eager(family, made):
    _, qdir, deq = made(family)
    _greedy_against_reference(LLM(model=str(qdir), dtype="float32", device="cpu", enforce_eager=True), deq)


@pytest.mark.slow  # 46 s on 2 CPU cores (`pytest -m slow`); the default run checks the compiled
# graph's logits against eager in test_cpu_pipeline_keeps_the_fp8_gemms_and_fuses_the_latent_norm_rope
def test_greedy_32_tokens_agree_with_transformers_compiled(made, tmp_path):
    """The V3-style FP8 model through the compile path (trace, passes, Inductor, artifact)."""
    _, qdir, deq = made("deepseek_v3")
    llm = LLM(model=str(qdir), dtype="float32", device="cpu", cache_dir=str(tmp_path))
    assert llm.engine.runner.compile_info["format"] == "aot_fn"
    _greedy_against_reference(llm, deq)


def test_kv_b_proj_is_dequantised_into_the_model_dtype(made):
    """bf16 activations: kv_b_proj's weight is the dequantised fp32 weight rounded once to bf16 (the
    absorbed attention's bmm reads it in the activation dtype); the FP8 linears keep their bytes."""
    _, qdir, _ = made("deepseek_v3")
    model = load_model(qdir, torch.bfloat16, "cpu")
    want = fc.dequantized_weights(qdir)
    attn = model.model.layers[1].self_attn
    assert attn.kv_b_proj.weight.dtype == torch.bfloat16
    assert torch.equal(attn.kv_b_proj.weight, want["model.layers.1.self_attn.kv_b_proj"].to(torch.bfloat16))
    w_uk, w_uv = attn.absorbed_weights()
    assert w_uk.dtype == w_uv.dtype == torch.bfloat16
    assert attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.isfinite(_logits(model, torch.tensor(PROMPT)).float()).all()


def fake_quant_inputs(model, fp8_model, method=FP8BlockLinearMethod, activation="group") -> None:
    """Round the input of each linear that runs `method` in `fp8_model` through FP8 as it does (per
    128-value group, or per token), on a dense atomc model of the same weights: what the FP8 load
    computes, by other means."""
    fp8 = {n for n, m in _methods(fp8_model).items() if m is method}
    for name, m in model.named_modules():
        if name in fp8:
            m.register_forward_pre_hook(lambda mod, args: (fc.fake_quant(args[0], activation, group=128),))


def _mtp_logits(model, ids):
    with torch.no_grad():
        h = model(ids, torch.arange(ids.numel()))
        return model.mtp_compute_logits(model.mtp_forward(ids[1:], torch.arange(ids.numel() - 1), h[:-1]))


@pytest.mark.parametrize("eh_proj", [False, True], ids=["eh_proj-bf16", "eh_proj-fp8"])
def test_mtp_layer_loads_like_the_main_layers(eh_proj, made):
    """The MTP layer's decoder linears are FP8 like the main sparse layers', its kv_b_proj dequantised,
    its router dense; eh_proj is FP8 exactly where the checkpoint stores its scales (DeepSeek-V3/R1:
    bf16). Its draft logits equal the dense atomc MTP's on the dequantised checkpoint (validated
    against transformers in tests/models/test_deepseek_mtp.py) with the same activation rounding."""
    _, qdir, deq = made("deepseek_v3-mtp" + ("-eh" if eh_proj else ""))
    model = load_model(qdir, torch.float32, "cpu", mtp=True)
    want = fc.dequantized_weights(qdir)
    layer, ckpt = model.mtp[0], "model.layers.2."
    methods = _methods(layer)
    assert methods["eh_proj"] is (FP8BlockLinearMethod if eh_proj else UnquantizedLinearMethod)
    shared = () if deepseek.FUSE_SHARED_EXPERTS else ("block.mlp.shared_experts.down_proj",)  # else in the op
    for name in ("block.self_attn.qkv_a_proj", "block.self_attn.o_proj", *shared):
        assert methods[name] is FP8BlockLinearMethod
    assert methods["block.self_attn.kv_b_proj"] is DequantizedFP8BlockLinearMethod
    assert methods["block.mlp.gate"] is UnquantizedLinearMethod
    assert isinstance(layer.block.mlp.experts.moe_method, Fp8MoEMethod)
    assert torch.equal(layer.block.self_attn.kv_b_proj.weight, want[ckpt + "self_attn.kv_b_proj"])
    if not eh_proj:
        assert torch.equal(layer.eh_proj.weight, load_file(str(qdir / "model.safetensors"))[ckpt + "eh_proj.weight"])
    assert ("mtp.0.eh_proj" in model.quant_schemes) == eh_proj
    dense = load_model(deq, torch.float32, "cpu", mtp=True)
    fake_quant_inputs(dense, model)
    ids = torch.arange(5, 41) * 11 % 384
    assert_close_to_reference(_logits(model, ids), _logits(dense, ids))
    assert_close_to_reference(_mtp_logits(model, ids), _mtp_logits(dense, ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_online_fp8_keeps_kv_b_proj_and_the_router_dense(family, made, tmp_path):
    """`--quantization fp8` on a bf16 DeepSeek checkpoint: every other linear and the experts are
    quantised per row at load; kv_b_proj (read by the absorbed attention's bmm) and the router stay
    bf16. Against atomc's own bf16 run the median token's max |diff| stays under 15% of the largest
    logit (the per-row and per-token FP8 rounding, as test_fp8_models.py measures for Llama); in
    fp32 against the same rounding done by other means, within the module docstring's rule."""
    base, _, _ = made(family)
    online = load_model(base, torch.bfloat16, "cpu", quantization="fp8")
    methods = _methods(online)
    assert methods["model.layers.1.self_attn.kv_b_proj"] is UnquantizedLinearMethod
    assert methods["model.layers.1.mlp.gate"] is UnquantizedLinearMethod
    assert methods["model.layers.1.self_attn.qkv_a_proj"] is OnlineFP8LinearMethod
    attn = online.model.layers[1].self_attn
    assert attn.kv_b_proj.weight.dtype == torch.bfloat16 and attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert online.model.layers[1].mlp.experts.moe_method.weight_format == "fp8_channel"
    ids = torch.tensor(PROMPT * 3)
    got, ref = _logits(online, ids).float(), _logits(load_model(base, torch.bfloat16, "cpu"), ids).float()
    assert torch.isfinite(got).all()
    rel = ((got - ref).abs().amax(-1) / ref.abs().max()).median().item()
    assert rel < PLAIN_MEDIAN_REL, rel
    # fp32: the dense model of the per-row-rounded weights (kv_b_proj unrounded), each online FP8
    # linear's input rounded per token: the same computation, held to the module docstring's rule
    fp32 = load_model(base, torch.float32, "cpu", quantization="fp8")
    chunk = fp32.config.moe.intermediate_size if deepseek.FUSE_SHARED_EXPERTS else None  # a shared expert's rows
    ref_dir = dc.online_reference_checkpoint(base, tmp_path / "online-ref", shared_columns=chunk)
    dense = load_model(ref_dir, torch.float32, "cpu")
    fake_quant_inputs(dense, fp32, OnlineFP8LinearMethod, "token")
    assert_close_to_reference(_logits(fp32, ids), _logits(dense, ids))


def _arch(made, family: str, **changes) -> ModelArch:
    arch = ModelArch.from_dir(made(family)[1])
    arch.raw = {**arch.raw, **changes}
    return arch


@pytest.mark.parametrize(
    "family, changes, error, message",
    [
        # 64-row blocks: the linears' sections are whole blocks, but FP8 experts run 128x128 only
        ("deepseek_v3", dict(quantization_config={**dc.QUANTIZATION_CONFIG, "weight_block_size": [64, 64]}),
         QuantConfigError, r"weight_block_size \[64, 64\]: FP8 MoE experts run 128x128 blocks only"),
        # a q LoRA of 96 rows: q's section would end inside a block that kv_a's rows continue
        ("deepseek_v3", dict(q_lora_rank=96), QuantConfigError,
         r"section 0 of MergedColumnParallelLinear holds 96 rows .* another section starts after it"),
        # o_proj reads 4 heads x 16 values: not whole 128-value groups for its activation quant
        ("deepseek_v2", dict(v_head_dim=16), QuantConfigError, r"RowParallelLinear has 64 input features on this rank"),
        ("deepseek_v3", dict(quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"}), ValueError,
         r"quantization_config without weight_block_size \(per-tensor FP8\) is not supported"),
        ("deepseek_v2", dict(quantization_config={"quant_method": "compressed-tensors"}), ValueError,
         r"quantization_config.quant_method='compressed-tensors' is not supported for DeepseekV2ForCausalLM"),
    ],
)  # fmt: skip
def test_configs_atomc_cannot_run_are_refused_naming_the_field(family, changes, error, message, made):
    with pytest.raises(error, match=message):
        build_on_meta(_arch(made, family, **changes), torch.float32)


def test_cpu_pipeline_keeps_the_fp8_gemms_and_fuses_the_latent_norm_rope(made):
    """The traced V3-style FP8 model through the CPU passes: the logits of the eager model; the only
    F.linear left is the dense router (lm_head is outside the forward); the latent's norm + RoPE
    still fuse (one per layer) as in bf16; the norms before FP8 GEMMs fuse with their quants."""
    from atomc.passes import PassManager

    _, qdir, _ = made("deepseek_v3")
    model = load_model(qdir, torch.float32, "cpu")
    ids, positions = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(0)), torch.arange(9)
    pm, reports = PassManager.for_platform("cpu"), []

    def backend(gm, example_inputs):
        reports[:] = pm.run(gm)
        return gm

    compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        want = _logits(model, ids)
        got = model.compute_logits(compiled(ids, positions))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    by_name = {r.name: (r.matched, r.rewritten) for r in reports}
    assert by_name["fuse_mla_latent_norm_rope"] == (2, 2)
    # SiLU·mul + quant: the dense layer's MLP, and the MoE layer's shared experts unless the op holds them
    silu_quants = 1 if deepseek.FUSE_SHARED_EXPERTS else 2
    assert by_name["fuse_rmsnorm_fp8_quant"][1] > 0 and by_name["fuse_silu_mul_fp8_quant"] == (silu_quants,) * 2
    code = reports[-1].graph_after
    assert code.count("torch._C._nn.linear") == 1  # layer 1's router
    assert "torch.ops.atomc.fp8_block_gemm" in code


def test_dequantised_block_weights_may_end_in_partial_blocks_both_ways():
    """kv_b_proj's method never quantises an input, so a layer of 96 inputs x 200 outputs (partial
    blocks in both dims) loads and dequantises: weight x its block's scale, in the layer's dtype."""
    from models.layers.linear import ColumnParallelLinear
    from models.quant.spec import FP8Scheme

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(200, 96, generator=g) * 2).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 1, generator=g) / 100 + 1e-3
    layer = ColumnParallelLinear(
        96, 200, linear_method=DequantizedFP8BlockLinearMethod(FP8Scheme("block", "group", (128, 128)))
    )
    for name, t in (("weight", w), ("weight_scale_inv", scale)):
        param = getattr(layer, name)
        param.weight_loader(param, t)
    layer.linear_method.process_weights_after_loading(layer)
    want = w.float() * torch.cat([scale[0].expand(128, 96), scale[1].expand(72, 96)])
    assert layer.weight.dtype == torch.float32 and not hasattr(layer, "weight_scale_inv")
    assert torch.equal(layer.weight, want)
