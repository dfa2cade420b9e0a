"""The safetensors loader: clear errors naming the tensor (missing, unexpected, wrong shape), tied
heads, ignored buffers, the dummy format, and the shapes a checkpoint of a model holds."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.loader import load_model
from models.loader.safetensors import build_on_meta, checkpoint_shapes, map_checkpoint_name


def edited_copy(src, dst, edit):
    """A copy of checkpoint `src` at `dst` whose tensors went through `edit(dict)`."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_section_of_a_merged_layer_is_named(checkpoints, tmp_path):
    path = edited_copy(checkpoints["llama"], tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing: model\.layers\.1\.self_attn\.k_proj\.weight$"):
        load_model(path, torch.float32, "cpu")


def test_missing_whole_tensors_are_named(checkpoints, tmp_path):
    def drop(t):
        t.pop("lm_head.weight")
        t.pop("model.layers.0.mlp.gate_proj.weight")
        t.pop("model.layers.0.mlp.up_proj.weight")

    path = edited_copy(checkpoints["llama"], tmp_path / "m", drop)
    with pytest.raises(ValueError) as err:
        load_model(path, torch.float32, "cpu")
    msg = str(err.value)
    for name in ("lm_head.weight", "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        assert name in msg


def test_unexpected_tensor_is_named(checkpoints, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)

    path = edited_copy(checkpoints["llama"], tmp_path / "u", add)
    with pytest.raises(ValueError, match=r"unexpected: model\.layers\.0\.self_attn\.extra_proj\.weight"):
        load_model(path, torch.float32, "cpu")


@pytest.mark.parametrize(
    "name, shape",
    [("model.layers.0.self_attn.v_proj.weight", (16, 64)), ("model.norm.weight", (63,))],
)
def test_wrong_shape_names_the_tensor_and_file(checkpoints, tmp_path, name, shape):
    def reshape(t):
        t[name] = torch.zeros(shape)

    path = edited_copy(checkpoints["llama"], tmp_path / "s", reshape)
    with pytest.raises(ValueError, match=re.escape(f"model.safetensors: {name} has shape {tuple(shape)}")):
        load_model(path, torch.float32, "cpu")


def test_tied_head_loads_with_or_without_its_tensor(checkpoints, tmp_path):
    src = checkpoints["qwen2"]  # tied embeddings
    assert "lm_head.weight" not in load_file(str(src / "model.safetensors"))

    def add_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    with_head = edited_copy(src, tmp_path / "t", add_head)
    a, b = load_model(src, torch.float32, "cpu"), load_model(with_head, torch.float32, "cpu")
    for m in (a, b):
        assert m.lm_head.weight is m.model.embed_tokens.weight
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_rotary_inv_freq_in_a_checkpoint_is_ignored(checkpoints, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    load_model(edited_copy(checkpoints["llama"], tmp_path / "r", add), torch.float32, "cpu")


def test_unknown_load_format(checkpoints):
    with pytest.raises(ValueError, match="load format 'pt' is not one of: safetensors, dummy"):
        load_model(checkpoints["llama"], torch.float32, "cpu", "pt")


def test_dummy_weights_keep_ties_and_shapes(checkpoints):
    model = load_model(checkpoints["qwen3"], torch.float32, "cpu", "dummy")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.layers[0].self_attn.q_norm.weight, torch.ones(32))
    assert model.model.layers[0].self_attn.qkv_proj.weight.std() > 0
    logits = model.compute_logits(model(torch.arange(5), torch.arange(5)))
    assert logits.shape == (5, 384) and torch.isfinite(logits).all()


def test_build_materialise_keeps_the_dtype_and_meta_costs_nothing(checkpoints):
    from models.arch import ModelArch

    arch = ModelArch.from_dir(checkpoints["llama"])
    meta = build_on_meta(arch, torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in meta.parameters())
    model = load_model(checkpoints["llama"], torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in model.parameters())
    assert all(hasattr(p, "weight_loader") for p in model.model.layers[0].self_attn.parameters())


def test_name_mapping_matches_whole_components():
    mapping = {"k_proj": ("qkv_proj", "k"), "up_proj": ("gate_up_proj", 1)}
    assert map_checkpoint_name("model.layers.3.self_attn.k_proj.bias", mapping) == (
        "model.layers.3.self_attn.qkv_proj.bias",
        "k",
    )
    assert map_checkpoint_name("model.layers.0.mlp.gate_up_proj.weight", mapping) == (
        "model.layers.0.mlp.gate_up_proj.weight",
        None,
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "qwen3_moe", "mixtral"])
def test_checkpoint_shapes_are_the_checkpoints(checkpoints, family):
    model = load_model(checkpoints[family], torch.float32, "cpu")
    ckpt = {n: tuple(t.shape) for n, t in load_file(str(checkpoints[family] / "model.safetensors")).items()}
    shapes = checkpoint_shapes(model)
    if model.arch.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    assert shapes == ckpt


def test_an_8b_shape_builds_without_any_init():
    """The dummy format and every load build on meta: no CPU init of a full model, whatever its size."""
    import time

    from models.arch import ModelArch

    cfg = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=5e5,
    )  # fmt: skip
    start = time.perf_counter()
    model = build_on_meta(ModelArch.from_dict(cfg), torch.bfloat16)
    assert time.perf_counter() - start < 5.0
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.03


def test_dummy_fp8_weights_fill_in_slices_deterministically():
    """FP8 parameters are filled through fp32 a slice at a time (a whole fp32 temporary of
    DeepSeek-V3's stacked experts is 7 GiB): every row gets values, the same for the same seed."""
    from models.loader.safetensors import fill_dummy_weights

    def model():
        m = torch.nn.Module()
        m.w = torch.nn.Parameter(torch.zeros(3, 1 << 25, dtype=torch.float8_e4m3fn), requires_grad=False)
        m.s = torch.nn.Parameter(torch.zeros((), dtype=torch.float8_e4m3fn), requires_grad=False)
        return m

    a, b = model(), model()
    fill_dummy_weights(a, seed=1)
    fill_dummy_weights(b, seed=1)
    rows = a.w.float()
    assert (rows.abs().amax(1) > 0).all() and rows.isfinite().all()
    assert 0.9 < rows[:, :4096].std() < 1.1
    assert torch.equal(a.w.view(torch.uint8), b.w.view(torch.uint8)) and a.s.float() != 0


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_online_fp8_loads_one_layer_at_a_time(checkpoints, monkeypatch, family, load_format):
    """--quantization fp8 quantises each layer before the next one is materialised, so a load holds
    at most one layer's unquantised weights (Mixtral-8x7B's FP8 fits an 80 GB GPU; its bf16 does
    not): when a decoder layer is processed, every later layer is still on the meta device and
    every earlier one is already e4m3."""
    from models.loader import safetensors as loader

    seen = []
    real = loader.process_weights_after_loading

    def spy(model, group=None):
        layers = model.model.layers
        here = next((i for i, layer in enumerate(layers) if group and f"model.layers.{i}" in group), None)
        if here is not None:
            later = [p.is_meta for layer in layers[here + 1 :] for p in layer.parameters()]
            earlier = [layer.self_attn.qkv_proj.weight.dtype for layer in layers[:here]]
            seen.append((here, all(later), set(earlier) <= {torch.float8_e4m3fn}))
        real(model, group)

    monkeypatch.setattr(loader, "process_weights_after_loading", spy)
    model = load_model(checkpoints[family], torch.float32, "cpu", load_format, quantization="fp8")
    n = len(model.model.layers)
    assert [s[0] for s in seen] == list(range(n)) and n >= 2
    assert all(later_meta and earlier_fp8 for _, later_meta, earlier_fp8 in seen)
    assert not any(p.is_meta for p in model.parameters())
    assert not any(hasattr(p, "_atomc_loaded_shards") for p in model.parameters())


def test_layer_groups_put_the_shared_modules_first(checkpoints):
    from models.arch import ModelArch
    from models.loader.safetensors import layer_groups

    groups = layer_groups(build_on_meta(ModelArch.from_dir(checkpoints["llama"]), torch.float32))
    assert "model.embed_tokens" in groups[0] and "lm_head" in groups[0] and "model.norm" in groups[0]
    assert [next(iter(g)) for g in groups[1:]] == [f"model.layers.{i}" for i in range(len(groups) - 1)]
    assert all(name.startswith(next(iter(g))) for g in groups[1:] for name in g)


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_online_fp8_frees_each_layers_unquantised_weights(checkpoints, monkeypatch, load_format):
    """When a layer is processed, the unquantised weights of the layers before it are gone: nothing
    in the loader keeps them (once, a dict of the materialised parameters did, and the FP8 loads of
    Qwen3-30B-A3B and Mixtral ran out of memory on an 80 GB GPU)."""
    import gc
    import weakref

    from models.loader import safetensors as loader

    before: list[weakref.ref] = []
    alive_at_processing = []
    real = loader.process_weights_after_loading

    def spy(model, group=None):
        gc.collect()
        alive_at_processing.append(sum(r() is not None for r in before))
        layers = [n for n in (group or []) if n.endswith("qkv_proj") or n.endswith("experts")]
        mods = dict(model.named_modules())
        before.extend(
            weakref.ref(p) for n in layers for p in mods[n].parameters(recurse=False) if p.dtype == torch.float32
        )
        real(model, group)

    monkeypatch.setattr(loader, "process_weights_after_loading", spy)
    load_model(checkpoints["mixtral"], torch.float32, "cpu", load_format, quantization="fp8")
    gc.collect()
    assert len(before) > 2 and alive_at_processing and max(alive_at_processing) == 0
    assert all(r() is None for r in before)
