"""The MoE families (Qwen3-MoE, Mixtral) against transformers on tiny random checkpoints, fp32.

Shared family tests (test_families.py: prompt logits, 32 eager greedy tokens; tests/graphs/
test_engine.py: compiled vs eager) run them through the `family` fixture. Here: short prompts that
leave experts idle and load the others unevenly, a Qwen3-MoE whose layers alternate dense and
sparse (`decoder_sparse_step`, `mlp_only_layers`) without renormalised weights, 32 greedy tokens
on the compiled artifact, both checkpoint layouts transformers writes (per expert, or stacked), the
loader's names for missing expert tensors, and the configs atomc refuses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from atomc import LLM, SamplingParams
from atomc.ops.moe import select_experts
from models.arch import ModelArch
from models.layers.moe import SparseMoEBlock
from models.loader import load_model
from tests.conftest import FAMILIES, build_checkpoint
from tests.greedy import assert_greedy_agree

PROMPTS = ["The capital of France is", "Once upon a time there", "def add(a, b):\n"]
MOE = ["qwen3_moe", "mixtral", "qwen3_moe_sparse"]
# layers 1 and 3 pass the sparse step of 2; layer 3 is forced dense: only layer 1 is sparse
SPARSE = dict(FAMILIES["qwen3_moe"], decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False)


@pytest.fixture(scope="module")
def moe_dirs(checkpoints, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(FAMILIES, "qwen3_moe_sparse", SPARSE)
        sparse = build_checkpoint("qwen3_moe_sparse", tmp_path_factory.mktemp("sparse"), num_layers=4)
    return {"qwen3_moe": checkpoints["qwen3_moe"], "mixtral": checkpoints["mixtral"], "qwen3_moe_sparse": sparse}


@pytest.fixture(scope="module")
def hf_models(moe_dirs):
    return {
        f: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for f, d in moe_dirs.items()
    }


def expert_loads(model, ids) -> list[torch.Tensor]:
    """Tokens per expert in each sparse layer for one forward of `ids`."""
    loads, hooks = [], []
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoEBlock):
            k, e = layer.mlp.experts.spec.top_k, layer.mlp.experts.num_experts

            def hook(_mod, _inp, logits, k=k, e=e):
                loads.append(torch.bincount(select_experts(logits, k)[1].flatten().long(), minlength=e))

            hooks.append(layer.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(ids, torch.arange(ids.numel()))
    for h in hooks:
        h.remove()
    return loads


@pytest.mark.parametrize("family", MOE)
def test_short_prompts_idle_some_experts_and_match_transformers(family, moe_dirs, hf_models):
    model = load_model(moe_dirs[family], torch.float32, "cpu")
    tok = transformers.AutoTokenizer.from_pretrained(moe_dirs[family])
    idle = uneven = 0
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids[0]
        loads = expert_loads(model, ids)
        assert loads and all(int(n.sum()) == 2 * ids.numel() for n in loads)
        idle += sum(int((n == 0).sum()) for n in loads)
        uneven += sum(int(n.max() > n[n > 0].min()) for n in loads)
        with torch.no_grad():
            ref = hf_models[family](ids[None]).logits[0]
            out = model.compute_logits(model(ids, torch.arange(ids.numel())))
        assert (out - ref).abs().max().item() < 1e-3
    assert idle > 0 and uneven > 0  # experts without a token, and experts with more than others


def test_sparse_step_and_mlp_only_layers_choose_each_layers_mlp(moe_dirs, hf_models):
    model = load_model(moe_dirs["qwen3_moe_sparse"], torch.float32, "cpu")
    ours = [isinstance(layer.mlp, SparseMoEBlock) for layer in model.model.layers]
    theirs = [
        type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf_models["qwen3_moe_sparse"].model.layers
    ]
    assert ours == theirs == [False, True, False, False]
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (256, 64)  # dense layers: intermediate_size
    assert model.model.layers[1].mlp.experts.w13_weight.shape == (8, 96, 64)  # experts: moe_intermediate_size
    assert not model.model.layers[1].mlp.experts.spec.renormalize


def test_sparse_config_greedy_matches_transformers_eager(moe_dirs, hf_models):
    run_greedy(moe_dirs["qwen3_moe_sparse"], hf_models["qwen3_moe_sparse"], enforce_eager=True)


@pytest.mark.parametrize("family", MOE)
def test_compiled_greedy_matches_transformers(family, moe_dirs, hf_models, tmp_path_factory):
    llm = run_greedy(moe_dirs[family], hf_models[family], enforce_eager=False,
                     cache_dir=str(tmp_path_factory.mktemp("cache")))  # fmt: skip
    info = llm.engine.runner.compile_info
    assert info["key"] and info["format"] == "aot_fn"
    # the compile report lists one MoE node per sparse layer
    flops = json.loads((Path(info["entry"]) / "manifest.json").read_text())["flops"]
    sparse = sum(isinstance(layer.mlp, SparseMoEBlock) for layer in llm.engine.runner.model.model.layers)
    assert len(flops["moe_nodes"]) == sparse > 0


def run_greedy(path, hf, **kw) -> LLM:
    llm = LLM(model=str(path), dtype="float32", device="cpu", **kw)
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = hf.generate(ids, do_sample=False, max_new_tokens=32, min_new_tokens=32)

        def hf_logits(seq, hf=hf):
            with torch.no_grad():
                return hf(torch.tensor([seq])).logits[0]

        assert len(out.outputs[0].token_ids) == 32
        assert_greedy_agree(out.outputs[0].token_ids, ref[0, ids.shape[1] :].tolist(), ids[0].tolist(), hf_logits)
    return llm


# ---- checkpoint layouts and names ----


def stacked_copy(src, dst):
    """The checkpoint as transformers holds it in memory: experts stacked, Mixtral's block named mlp."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.save_pretrained(dst, save_original_format=False)
    return dst


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_stacked_experts_load_like_per_expert_tensors(family, moe_dirs, tmp_path):
    per_expert = moe_dirs[family]
    stacked = stacked_copy(per_expert, tmp_path / "stacked")
    names = set(load_file(str(stacked / "model.safetensors")))
    layer = "model.layers.0.mlp."
    assert {layer + "experts.gate_up_proj", layer + "experts.down_proj", layer + "gate.weight"} <= names
    assert not any(".experts.0." in n or "block_sparse_moe" in n for n in names)
    per_expert_names = set(load_file(str(per_expert / "model.safetensors")))
    want = {
        "qwen3_moe": layer + "experts.3.up_proj.weight",
        "mixtral": "model.layers.0.block_sparse_moe.experts.3.w3.weight",
    }
    assert want[family] in per_expert_names
    a, b = load_model(per_expert, torch.float32, "cpu"), load_model(stacked, torch.float32, "cpu")
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "family, name",
    [
        ("qwen3_moe", "model.layers.1.mlp.experts.3.up_proj.weight"),
        ("qwen3_moe", "model.layers.0.mlp.gate.weight"),
        ("mixtral", "model.layers.1.block_sparse_moe.experts.5.w3.weight"),
        ("mixtral", "model.layers.0.block_sparse_moe.experts.0.w2.weight"),
        ("mixtral", "model.layers.0.block_sparse_moe.gate.weight"),
    ],
)
def test_a_missing_expert_tensor_is_named_exactly(family, name, moe_dirs, tmp_path):
    path = edited_copy(moe_dirs[family], tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"checkpoint does not match the model's parameters; missing: {name}$"):
        load_model(path, torch.float32, "cpu")


def test_a_missing_stack_is_named_in_the_stacked_layout(moe_dirs, tmp_path):
    stacked = stacked_copy(moe_dirs["mixtral"], tmp_path / "stacked")
    name = "model.layers.1.mlp.experts.down_proj"
    path = edited_copy(stacked, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing: {name}$"):
        load_model(path, torch.float32, "cpu")


def test_unexpected_and_out_of_range_expert_tensors(moe_dirs, tmp_path):
    def add(t):
        t["model.layers.0.mlp.experts.2.extra_proj.weight"] = torch.zeros(2, 2)

    path = edited_copy(moe_dirs["qwen3_moe"], tmp_path / "u", add)
    with pytest.raises(ValueError, match=r"unexpected: model\.layers\.0\.mlp\.experts\.2\.extra_proj\.weight"):
        load_model(path, torch.float32, "cpu")

    def add_expert(t):
        t["model.layers.0.mlp.experts.8.up_proj.weight"] = t["model.layers.0.mlp.experts.7.up_proj.weight"].clone()

    path = edited_copy(moe_dirs["qwen3_moe"], tmp_path / "r", add_expert)
    with pytest.raises(ValueError, match=r"experts\.8\.up_proj\.weight expert 8 is out of range"):
        load_model(path, torch.float32, "cpu")


# ---- configs atomc refuses ----


def qwen3_moe_config(moe_dirs, **edit):
    cfg = json.loads((moe_dirs["qwen3_moe"] / "config.json").read_text())
    cfg.update(edit)
    return {k: v for k, v in cfg.items() if v is not None}


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(shared_expert_intermediate_size=64), "no shared expert"),
        (dict(moe_intermediate_size=None), "config.json has no moe_intermediate_size"),
        (dict(num_local_experts=None, num_experts=None), "no num_experts / num_local_experts"),
        (dict(num_experts_per_tok=9), "top_k=9 must be between 1 and the number of experts"),
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    ],
)
def test_unsupported_qwen3_moe_configs_are_clear_errors(moe_dirs, edit, match):
    from models.registry import parse_family_config

    with pytest.raises(ValueError, match=match):
        parse_family_config(ModelArch.from_dict(qwen3_moe_config(moe_dirs, **edit)))


def test_qwen2_moe_is_not_a_supported_architecture(moe_dirs):
    cfg = qwen3_moe_config(moe_dirs, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe")
    with pytest.raises(ValueError, match="architecture 'Qwen2MoeForCausalLM' is not supported"):
        ModelArch.from_dict(cfg)


def test_the_hub_config_spelling_num_experts_is_read(moe_dirs):
    from models.registry import parse_family_config

    raw = qwen3_moe_config(moe_dirs)
    raw["num_experts"] = raw.pop("num_local_experts")  # the hub's Qwen3-30B-A3B spelling
    cfg = parse_family_config(ModelArch.from_dict(raw))
    assert cfg.moe.num_experts == 8 and cfg.moe_layers == frozenset({0, 1}) and cfg.moe.renormalize


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_rank_loads_its_slice_of_each_expert(moe_dirs, rank):
    from models.layers.parallel import ParallelInfo

    ckpt = load_file(str(moe_dirs["mixtral"] / "model.safetensors"))
    model = load_model(moe_dirs["mixtral"], torch.float32, "cpu", parallel=ParallelInfo(rank, 2))
    experts = model.model.layers[1].mlp.experts
    n = experts.local_intermediate
    assert n == 64 and experts.w13_weight.shape == (8, 128, 64)
    pre = "model.layers.1.block_sparse_moe.experts.6."
    rows = slice(rank * n, (rank + 1) * n)
    assert torch.equal(experts.w13_weight[6, :n], ckpt[pre + "w1.weight"][rows])
    assert torch.equal(experts.w13_weight[6, n:], ckpt[pre + "w3.weight"][rows])
    assert torch.equal(experts.w2_weight[6], ckpt[pre + "w2.weight"][:, rows])
    assert torch.equal(model.model.layers[1].mlp.gate.weight, ckpt["model.layers.1.block_sparse_moe.gate.weight"])
