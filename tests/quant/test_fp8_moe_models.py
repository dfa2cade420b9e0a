"""FP8 MoE experts end to end on the CPU (fp32 activations): tiny Qwen3-MoE and Mixtral checkpoints
in each FP8 layout (tests/quant/fp8_moe_checkpoints.py) against transformers running the dequantised
weights, greedy agreement over 32 tokens, the traced and compiled paths, the loaded rows and scales
(gate and up apart, TP slices), input scales read and ignored, the Triton route (interpreted), the
compile-cache key, and the configs atomc refuses.

Tolerance against the reference (FAKE_QUANT_ATOL, 2e-2 on logits of magnitude ~2.5-4): the experts
run weight-only in both (the same dequantised weights, fp32 activations), and the non-expert linears'
inputs are rounded through FP8 the way the scheme does in both; measured difference ~1e-6. The bound
leaves room, as tests/quant/test_fp8_models.py explains, for an activation that lands on an FP8
rounding boundary to round the other way on a CPU that sums in another order (one e4m3 step through
these 0.08-std weights is ~1e-2 in a logit). Experts quantised wrongly (a scale on the wrong rows, a
per-tensor scale not repeated, the up half read with gate's scale) move the logits by 0.1 or more.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atomc import LLM, SamplingParams
from models.layers.parallel import ParallelInfo
from models.loader import load_model
from models.quant.fp8_moe import Fp8MoEMethod
from models.quant.spec import QuantConfigError, parse_quantization_config, resolve
from tests.greedy import assert_greedy_agree
from tests.quant import fp8_checkpoints as fc
from tests.quant import fp8_moe_checkpoints as mc

FAKE_QUANT_ATOL = 2e-2
PROMPT = [5, 17, 33, 2, 99, 150, 7, 8]
# case -> (family, layout, experts' format, the non-expert linears' activation rounding)
CASES = {
    "qwen3-hf-block": ("qwen3_moe", "hf-block", "fp8_block", "group"),
    "qwen3-ct-FP8_DYNAMIC": ("qwen3_moe", "ct-FP8_DYNAMIC", "fp8_channel", "token"),
    "qwen3-hf-dynamic-transformers-names": ("qwen3_moe", "hf-dynamic", "fp8_channel", "tensor"),
    "mixtral-hf-static": ("mixtral", "hf-static", "fp8_channel", "static"),
    "mixtral-ct-FP8": ("mixtral", "ct-FP8", "fp8_channel", "static"),
    "mixtral-quark-ptpc": ("mixtral", "quark-ptpc", "fp8_channel", "token"),
    "qwen3-online": ("qwen3_moe", "online", "fp8_channel", "token"),
    "mixtral-online": ("mixtral", "online", "fp8_channel", "token"),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """case -> (base dir, checkpoint dir atomc loads, dequantised reference dir, load kwargs)."""
    root, bases, cache = tmp_path_factory.mktemp("fp8moe"), {}, {}

    def get(case: str):
        if case not in cache:
            family, layout, _, _ = CASES[case]
            if family not in bases:
                bases[family] = mc.base(family, root / family)
            b = bases[family]
            if layout == "online":
                cache[case] = (b, b, mc.online_reference_checkpoint(b, root / f"{case}-ref"), {"quantization": "fp8"})
            else:
                q = mc.write(b, root / case, layout, transformers_names="transformers-names" in case)
                cache[case] = (b, q, mc.dequantized_checkpoint(b, q, root / f"{case}-ref"), {})
        return cache[case]

    return get


def _logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.numel())))


def _reference(case, qdir, ref_dir):
    return mc.reference(ref_dir, CASES[case][3], fc.input_scales(qdir))


def _experts(model):
    return [layer.mlp.experts for layer in model.model.layers]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_on_dequantised_weights(case, made):
    _, qdir, ref_dir, kw = made(case)
    model = load_model(qdir, torch.float32, "cpu", **kw)
    for experts in _experts(model):
        assert isinstance(experts.moe_method, Fp8MoEMethod) and experts.moe_method.weight_format == CASES[case][2]
        assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.float8_e4m3fn
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the router stays unquantised
    ids = torch.randint(0, 384, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _reference(case, qdir, ref_dir)(ids[None]).logits[0]
    torch.testing.assert_close(_logits(model, ids), want, atol=FAKE_QUANT_ATOL, rtol=0)


@pytest.mark.parametrize("case", ["qwen3-hf-block", "mixtral-hf-static", "qwen3-ct-FP8_DYNAMIC", "qwen3-online"])
def test_greedy_32_tokens_agree_with_transformers(case, made):
    _, qdir, ref_dir, kw = made(case)
    llm = LLM(model=str(qdir), dtype="float32", device="cpu", enforce_eager=True, **kw)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    ref = _reference(case, qdir, ref_dir)

    def ref_logits(seq):
        with torch.no_grad():
            return ref(torch.tensor([seq])).logits[0]

    # the reference's greedy tokens by its full forward: `generate(min_new_tokens=32)` would forbid
    # EOS, which atomc's ignore_eos still samples (it only does not stop there)
    want = []
    for _ in range(32):
        want.append(int(ref_logits(PROMPT + want)[-1].argmax()))
    assert_greedy_agree(out[0].outputs[0].token_ids, want, PROMPT, ref_logits, margin=FAKE_QUANT_ATOL)


def _dequantised(w, scale, block: bool) -> torch.Tensor:
    from atomc.ops.moe_quant import dequantize_fp8_experts

    return dequantize_fp8_experts(w, scale, block, torch.float32)


@pytest.mark.parametrize("case", ["qwen3-hf-block", "mixtral-hf-static", "mixtral-quark-ptpc"])
def test_stacked_experts_keep_each_tensors_scales(case, made):
    """w13 = expert x's gate rows then its up rows, each dequantising to exactly that checkpoint
    tensor's dequantised value (its own scale: per block, per row, or per tensor repeated on its rows);
    w2 = its down projection."""
    _, qdir, _, _ = made(case)
    want = fc.dequantized_weights(qdir)
    model = load_model(qdir, torch.float32, "cpu")
    experts = _experts(model)[1]
    block = CASES[case][2] == "fp8_block"
    w13 = _dequantised(experts.w13_weight, experts.w13_weight_scale, block)
    w2 = _dequantised(experts.w2_weight, experts.w2_weight_scale, block)
    names = ("gate_proj", "up_proj", "down_proj") if case.startswith("qwen3") else ("w1", "w3", "w2")
    container = "model.layers.1." + ("mlp.experts" if case.startswith("qwen3") else "block_sparse_moe.experts")
    i = experts.intermediate_size
    for x in range(experts.num_experts):
        gate, up, down = (want[f"{container}.{x}.{n}"] for n in names)
        assert not torch.equal(gate, up)
        assert torch.equal(w13[x, :i], gate) and torch.equal(w13[x, i:], up) and torch.equal(w2[x], down)
    if case == "mixtral-hf-static":  # one scale per tensor: constant on each half's rows, the halves apart
        s = experts.w13_weight_scale[0]
        assert (s[:i] == s[0]).all() and (s[i:] == s[i]).all() and s[0] != s[i]


@pytest.mark.parametrize("case", ["mixtral-hf-static", "mixtral-quark-ptpc"])
def test_tp2_ranks_hold_their_slices_of_rows_and_scales(case, made):
    """Each of 2 ranks holds its half of I: gate rows, up rows and down columns, with their scales."""
    _, qdir, _, _ = made(case)
    full = _experts(load_model(qdir, torch.float32, "cpu"))[0]
    w13 = _dequantised(full.w13_weight, full.w13_weight_scale, False)
    w2 = _dequantised(full.w2_weight, full.w2_weight_scale, False)
    i = full.intermediate_size
    n = i // 2
    for rank in (0, 1):
        part = _experts(load_model(qdir, torch.float32, "cpu", parallel=ParallelInfo(rank, 2)))[0]
        rows = torch.cat([w13[:, rank * n : (rank + 1) * n], w13[:, i + rank * n : i + (rank + 1) * n]], dim=1)
        assert torch.equal(_dequantised(part.w13_weight, part.w13_weight_scale, False), rows)
        assert torch.equal(
            _dequantised(part.w2_weight, part.w2_weight_scale, False), w2[:, :, rank * n : (rank + 1) * n]
        )


def _rewrite(qdir, out, edit_tensors=None, edit_config=None):
    shutil.copytree(qdir, out, dirs_exist_ok=True)
    if edit_tensors:
        tensors = load_file(str(qdir / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    if edit_config:
        cfg = mc.config(qdir)
        edit_config(cfg["quantization_config"])
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_experts_static_input_scales_are_read_and_ignored(made, tmp_path):
    """Mixtral-FP8-style static input scales: the experts' scaled by 1000 give the same logits (the
    MoE does not quantise its activations); a missing or non-positive one is an error, as the scheme
    promises them; after loading they are gone from the model."""
    _, qdir, _, _ = made("mixtral-hf-static")
    ids = torch.tensor(PROMPT)
    model = load_model(qdir, torch.float32, "cpu")
    assert not hasattr(_experts(model)[0], "w13_input_scale")
    base_logits = _logits(model, ids)

    def scale(tensors, by):
        for k in tensors:
            if ".experts." in k and k.endswith("input_scale"):
                tensors[k] = tensors[k] * by

    scaled = _rewrite(qdir, tmp_path / "x1000", lambda t: scale(t, 1000.0))
    assert torch.equal(_logits(load_model(scaled, torch.float32, "cpu"), ids), base_logits)
    zero = _rewrite(qdir, tmp_path / "zero", lambda t: scale(t, 0.0))
    with pytest.raises(QuantConfigError, match="input_scale of the checkpoint is not a finite positive number"):
        load_model(zero, torch.float32, "cpu")
    key = "model.layers.0.block_sparse_moe.experts.2.w3.input_scale"
    missing = _rewrite(qdir, tmp_path / "missing", lambda t: t.pop(key))
    with pytest.raises(ValueError, match=f"missing: {key}"):
        load_model(missing, torch.float32, "cpu")


def test_skip_lists_keep_experts_dense_and_disagreeing_experts_are_refused(made, tmp_path):
    _, qdir, _, _ = made("qwen3-ct-FP8_DYNAMIC")
    base = made("qwen3-ct-FP8_DYNAMIC")[0]
    # every expert ignored, the checkpoint's experts unquantised: dense atomc::moe, linears still FP8
    state, plain = load_file(str(qdir / "model.safetensors")), load_file(str(base / "model.safetensors"))
    for k in list(state):
        if ".experts." in k:
            state[k] = plain[k] if k in plain else None
    dense = _rewrite(qdir, tmp_path / "dense", None, lambda qc: qc["ignore"].append("re:.*mlp.experts.*"))
    save_file({k: v for k, v in state.items() if v is not None}, str(dense / "model.safetensors"))
    model = load_model(dense, torch.float32, "cpu")
    experts = _experts(model)[0]
    assert experts.moe_method is None and experts.w13_weight.dtype == torch.float32
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    # one expert's projection ignored, the others not: one stacked op cannot hold both
    odd = _rewrite(qdir, tmp_path / "odd", None, lambda qc: qc["ignore"].append("re:.*experts\\.1\\.up_proj$"))
    with pytest.raises(QuantConfigError, match=r"experts of model.layers.0.mlp.experts different schemes"):
        load_model(odd, torch.float32, "cpu")


def test_bad_fp8_expert_configs_are_clear_errors(made, tmp_path):
    _, block, _, _ = made("qwen3-hf-block")
    # a block size the MoE op does not run (the linears would; the experts would not)
    arch = {**mc.config(block), "quantization_config": {**mc.config(block)["quantization_config"],
                                                        "weight_block_size": [64, 64]}}  # fmt: skip
    with pytest.raises(QuantConfigError, match=r"quantization_config.weight_block_size \[64, 64\]: FP8 MoE experts"):
        _build(arch)
    # 128x128 blocks need whole blocks of gate and of up rows: I = 64 (Mixtral's tiny) has half a block
    _, mixtral, _, _ = made("mixtral-hf-static")
    cfg = mc.config(mixtral)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(QuantConfigError, match=r"the intermediate size \(64\) is not a multiple of the weight block"):
        _build(cfg)
    # tensor parallelism splitting I = 128 into two 64-row halves of a block
    with pytest.raises(QuantConfigError, match=r"intermediate size on this rank \(64\)|holds 64 rows on this rank"):
        load_model(block, torch.float32, "cpu", parallel=ParallelInfo(0, 2))
    # a per-tensor checkpoint whose expert scale is not one value
    _, static, _, _ = made("mixtral-hf-static")
    key = "model.layers.0.block_sparse_moe.experts.1.w1.weight_scale"
    bad = _rewrite(static, tmp_path / "bad", lambda t: t.__setitem__(key, torch.ones(2)))
    with pytest.raises(ValueError, match=f"{key} has shape \\(2,\\), but a per-tensor weight scale is one value"):
        load_model(bad, torch.float32, "cpu")


def _build(raw: dict):
    from models.arch import ModelArch
    from models.loader.safetensors import build_on_meta

    return build_on_meta(ModelArch.from_dict(raw), torch.float32)


def test_fp8_experts_enter_the_spec_key_and_the_compile_cache_key(made):
    from atomc.config import EngineConfig
    from atomc.graphs import build
    from atomc.graphs import cache_key as ck
    from models.arch import ModelArch
    from models.loader.safetensors import build_on_meta

    base, block, _, _ = made("qwen3-hf-block")
    assert resolve(mc.config(block)).key()["experts"] == "fp8_block"
    assert resolve(mc.config(made("mixtral-hf-static")[1])).key()["experts"] == "fp8_channel"
    assert resolve(mc.config(base), "fp8").key()["experts"] == "fp8_channel"
    assert parse_quantization_config({"quant_method": "mxfp4"}).key()["experts"] == "mxfp4"
    # a block size FP8 experts cannot take names none (dense models still run it on their linears)
    assert "experts" not in parse_quantization_config({"quant_method": "fp8", "weight_block_size": [64, 64]}).key()

    def factors(model_dir, quantization=None):
        cfg = EngineConfig(device="cpu")
        cfg.model.quantization = quantization
        return ck.collect_factors(
            model_dir, cfg, "cpu", torch.float32, [], source_files={}, splitting_ops=[], artifact_format="x"
        )

    plain = factors(base)
    assert [d[0] for d in ck.diff(plain, factors(base, "fp8"))] == ["quantization"]
    assert "model_config.quantization_config.weight_block_size" in {d[0] for d in ck.diff(plain, factors(block))}
    # the FP8 MoE method's file (its apply is traced) is hashed into the model's sources
    for model_dir, kw in ((block, {}), (base, {"quantization": "fp8"})):
        assert "models.quant.fp8_moe" in build.model_modules(
            build_on_meta(ModelArch.from_dir(model_dir), torch.float32, **kw)
        )
    assert "models.quant.fp8_moe" not in build.model_modules(build_on_meta(ModelArch.from_dir(base), torch.float32))


@pytest.mark.parametrize("case", ["qwen3-hf-block", "mixtral-quark-ptpc"])
def test_traced_graph_runs_moe_quant_with_the_experts_format(case, made):
    """Dynamo traces the FP8 MoE model whole; after the CPU passes each layer has one
    atomc::moe_quant in its format, the report names it, and the logits are the eager ones."""
    from atomc.graphs.report import format_report, graph_flops
    from atomc.passes import PassManager
    from tests.graphs.test_report import manifest

    _, qdir, _, _ = made(case)
    model = load_model(qdir, torch.float32, "cpu")
    ids = torch.randint(0, 300, (9,))
    ref = _logits(model, ids)
    seen = {}

    def backend(gm, example_inputs):
        PassManager.for_platform("cpu").run(gm)
        seen["flops"] = graph_flops(gm)
        return gm

    compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        got = model.compute_logits(compiled(ids, torch.arange(9)))
    fmt = CASES[case][2]
    nodes = seen["flops"]["moe_nodes"]
    assert len(nodes) == 2 and all(n["op"] == "atomc::moe_quant" and n["weight_format"] == fmt for n in nodes)
    assert f"{fmt} experts" in format_report(manifest(seen["flops"]))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_compiled_equals_eager(made, tmp_path):
    """One artifact build (about a minute on 2 cores): block FP8 experts through the whole compile
    path (trace, passes, Inductor, artifact) give the eager run's tokens."""
    _, qdir, _, _ = made("qwen3-hf-block")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = []
    for eager in (True, False):
        llm = LLM(model=str(qdir), dtype="float32", device="cpu", enforce_eager=eager, cache_dir=str(tmp_path))
        runs.append(llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids)
    assert runs[0] == runs[1]


def test_dummy_weights_fill_fp8_experts(made):
    _, qdir, _, _ = made("qwen3-hf-block")
    model = load_model(qdir, torch.float32, "cpu", load_format="dummy")
    experts = _experts(model)[0]
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and bool((experts.w13_weight_scale == 0.02).all())
    assert torch.isfinite(_logits(model, torch.tensor(PROMPT))).all()


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton interpreter runs on machines without CUDA")  # fmt: skip
@pytest.mark.parametrize("case", ["qwen3-hf-block", "mixtral-hf-static"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_triton_route_runs_the_loaded_experts(case, tokens, made):
    """The loaded layer's parameters as they are (layout, strides, scale shapes) through the Triton
    MoE (interpreted, fp32: the one-token GEMV and the small route) against the op's reference."""
    tile = dict(block_m=16, block_n=16, block_k=64, num_warps=4, num_stages=2)
    config = {"path": "gemv" if tokens == 1 else "small", "gate_up": tile, "down": tile}
    _, qdir, _, _ = made(case)
    experts = _experts(load_model(qdir, torch.float32, "cpu"))[0]
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, experts.hidden_size, generator=gen) * 0.5
    logits = torch.randn(tokens, experts.num_experts, generator=gen)
    args = (x, logits, experts.w13_weight, experts.w13_weight_scale, experts.w2_weight, experts.w2_weight_scale,
            None, None, None, None, 2, experts.moe_method.weight_format)  # fmt: skip
    want = torch.ops.atomc.moe_quant(*args)
    import atomc.kernels.triton.moe_quant as tq

    got = tq.fused_experts_quant(
        x, *tq.route(logits, 2, "softmax", True, None, 0, 0, 1.0), *args[2:6],
        weight_format=args[-1], config=config,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
