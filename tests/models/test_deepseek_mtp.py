"""DeepSeek-V3's MTP module (models/deepseek_mtp.py), fp32 on the CPU.

The checkpoint is the tiny V3 one (tests/conftest.py: deepseek_v3, 3 layers, the first dense) plus
random MTP tensors for layer 3 written into its safetensors: the decoder layer's tensors in the
same layout as the main layers' (layer 2's names, new values), enorm / hnorm / eh_proj /
shared_head.norm, and with `own_tables` the layer's own embed_tokens and shared_head.head. The
reference MTP forward is written here from the tensors themselves, with transformers'
DeepseekV3DecoderLayer (loaded by transformers from the same tensors) as the decoder layer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from atomc.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from atomc.kv_spec import MLAAttentionSpec
from atomc.runtime.kv_cache import allocate_kv_cache
from models.loader import load_model

N = 3  # the tiny V3's num_hidden_layers: the MTP layer is model.layers.3
MTP = f"model.layers.{N}."
HIDDEN, VOCAB = 64, 384


def with_mtp(src: Path, dst: Path, own_tables: bool, drop: tuple[str, ...] = (), tensors: bool = True) -> Path:
    """A copy of the V3 checkpoint `src` with an MTP layer (num_nextn_predict_layers = 1)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(11)

    def rand(shape, std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(shape, generator=g)

    extra = {}
    for name, t in sorted(weights.items()):  # layer 2 is sparse, as the MTP layer is
        if name.startswith(f"model.layers.{N - 1}."):
            std, mean = (0.1, 1.0) if name.endswith("norm.weight") else (0.08, 0.0)
            extra[MTP + name.split(".", 3)[3]] = rand(t.shape, 0.1 if name.endswith("_bias") else std, mean)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"{MTP}{norm}.weight"] = rand((HIDDEN,), 0.1, 1.0)
    extra[MTP + "eh_proj.weight"] = rand((HIDDEN, 2 * HIDDEN), 0.08)
    if own_tables:
        extra[MTP + "embed_tokens.weight"] = rand((VOCAB, HIDDEN), 0.08)
        extra[MTP + "shared_head.head.weight"] = rand((VOCAB, HIDDEN), 0.08)
    for name in drop:
        del extra[name]
    save_file({**weights, **(extra if tensors else {})}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return dst


@pytest.fixture(scope="module", params=[False, True], ids=["shared_tables", "own_tables"])
def mtp_dir(request, checkpoints, tmp_path_factory) -> Path:
    return with_mtp(checkpoints["deepseek_v3"], tmp_path_factory.mktemp("mtp") / "ckpt", own_tables=request.param)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp_logits(mtp_dir: Path, tmp_path: Path, ids: torch.Tensor) -> torch.Tensor:
    """Rows t = 0 .. L-2 (token t+1, the main model's normalised output h_t) -> logits guessing
    token t+2, from the checkpoint's tensors: zero the embedding at position 0, cat(enorm(e),
    hnorm(h)) through eh_proj, transformers' decoder layer, shared_head.norm, the head."""
    w = load_file(str(mtp_dir / "model.safetensors"))
    embed = w.get(MTP + "embed_tokens.weight", w["model.embed_tokens.weight"])
    head = w.get(MTP + "shared_head.head.weight", w["lm_head.weight"])
    main = transformers.AutoModelForCausalLM.from_pretrained(mtp_dir, dtype=torch.float32).eval()
    # the same checkpoint read as a 4-layer model: transformers builds and loads layer 3, the MTP
    # layer's decoder layer, from its tensors (the MTP-only tensors are left over, unused)
    ext = tmp_path / "as_four_layers"
    shutil.copytree(mtp_dir, ext)
    cfg = json.loads((ext / "config.json").read_text())
    (ext / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": N + 1}))
    four = transformers.AutoModelForCausalLM.from_pretrained(ext, dtype=torch.float32, attn_implementation="eager")
    layer = four.eval().model.layers[N]
    assert torch.equal(layer.self_attn.kv_b_proj.weight, w[MTP + "self_attn.kv_b_proj.weight"])
    with torch.no_grad():
        h = main.model(ids[None]).last_hidden_state[0, :-1]  # after the final norm
        t = h.shape[0]
        e = F.embedding(ids[1:], embed)
        e[0] = 0.0  # the row of position 0
        halves = [rms(e, w[MTP + "enorm.weight"]), rms(h, w[MTP + "hnorm.weight"])]  # embedding first
        x = torch.cat(halves, -1) @ w[MTP + "eh_proj.weight"].T
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        cos_sin = main.model.rotary_emb(x[None], pos)
        y = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        y = y[0] if isinstance(y, tuple) else y
        return rms(y[0], w[MTP + "shared_head.norm.weight"]) @ head.T


IDS = torch.arange(5, 41) * 11 % VOCAB


def atomc_mtp_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        h = model(ids, torch.arange(ids.numel()))
        return model.mtp_compute_logits(model.mtp_forward(ids[1:], torch.arange(ids.numel() - 1), h[:-1]))


def test_mtp_forward_equals_the_reference(mtp_dir, tmp_path):
    model = load_model(mtp_dir, torch.float32, "cpu", mtp=True)
    want = reference_mtp_logits(mtp_dir, tmp_path, IDS)
    got = atomc_mtp_logits(model, IDS)
    assert got.shape == want.shape == (IDS.numel() - 1, VOCAB)
    assert (got - want).abs().max().item() < 1e-3
    # and the check has teeth: the same weights with the halves of the concat swapped differ
    layer = model.mtp[0]
    with torch.no_grad():
        layer.eh_proj.weight.copy_(layer.eh_proj.weight.roll(HIDDEN, dims=1))
    assert (atomc_mtp_logits(model, IDS) - want).abs().max().item() > 1e-2


def test_absent_tables_are_the_main_models_own_ones_load(mtp_dir):
    model = load_model(mtp_dir, torch.float32, "cpu", mtp=True)
    layer = model.mtp[0]
    own = (MTP + "embed_tokens.weight") in load_file(str(mtp_dir / "model.safetensors"))
    assert (layer.embed_tokens.weight is model.model.embed_tokens.weight) == (not own)
    assert (layer.shared_head.head.weight is model.lm_head.weight) == (not own)
    if own:
        assert not torch.equal(layer.embed_tokens.weight, model.model.embed_tokens.weight)


def test_main_logits_unchanged_and_nothing_allocated_without_mtp(mtp_dir, checkpoints):
    plain = load_model(checkpoints["deepseek_v3"], torch.float32, "cpu")
    skipped = load_model(mtp_dir, torch.float32, "cpu")  # the MTP tensors are there, not asked for
    loaded = load_model(mtp_dir, torch.float32, "cpu", mtp=True)
    positions = torch.arange(IDS.numel())
    with torch.no_grad():
        logits = [m.compute_logits(m(IDS, positions)) for m in (plain, skipped, loaded)]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])

    def numel(m):
        return sum(p.numel() for p in m.parameters())

    assert len(skipped.mtp) == 0 and numel(skipped) == numel(plain) < numel(loaded)
    spec = MLAAttentionSpec(32, 8)
    assert plain.kv_cache_specs() == skipped.kv_cache_specs() == [spec] * N
    assert loaded.kv_cache_specs() == [spec] * (N + 1)
    assert loaded.mtp[0].block.self_attn.layer_idx == N
    assert type(loaded.mtp[0].block.mlp).__name__ == "DeepseekMoE"


def test_mtp_attends_over_its_own_latent_cache(mtp_dir):
    """Prefill rows 0..T-2 then decode row T-1 through paged caches of all N + 1 layers: only the
    MTP layer's (index N) is written, and the decode row equals a cacheless forward's last row."""
    model = load_model(mtp_dir, torch.float32, "cpu", mtp=True)
    ids = IDS[:20]
    with torch.no_grad():
        h = model(ids, torch.arange(ids.numel()))[:-1]
        inputs, t = ids[1:], ids.numel() - 1
        want = model.mtp_forward(inputs, torch.arange(t), h)
    block, table = 4, [6, 1, 4, 0, 3]
    caches = allocate_kv_cache(model.kv_cache_specs(), 8, block, torch.float32, "cpu", lambda s: "NHD")
    slots = [table[p // block] * block + p % block for p in range(t)]

    def step(start: int, end: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots[start:end]),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=torch.tensor([table], dtype=torch.int32),
            query_start_loc_host=[0, end - start],
            seq_lens_host=[end],
            max_query_len=end - start,
            max_seq_len=end,
            num_seqs=1,
        )
        with torch.no_grad(), set_forward_context(ForwardContext(meta, caches)):
            return model.mtp_forward(inputs[start:end], torch.arange(start, end), h[start:end])

    prefill, decode = step(0, t - 1), step(t - 1, t)
    assert (prefill - want[:-1]).abs().max().item() < 1e-5
    assert (decode - want[-1:]).abs().max().item() < 1e-5
    assert all(not k.any() for k, _ in caches[:N])
    latent = caches[N][0].reshape(-1, caches[N][0].shape[-1])
    assert sorted(latent.any(-1).nonzero().flatten().tolist()) == sorted(slots)


@pytest.mark.parametrize(
    "drop",
    [
        MTP + "hnorm.weight",
        MTP + "eh_proj.weight",
        MTP + "self_attn.kv_b_proj.weight",
        MTP + "mlp.experts.5.up_proj.weight",
        MTP + "mlp.gate.e_score_correction_bias",
    ],
)
def test_an_incomplete_mtp_layer_names_the_missing_tensor(drop, checkpoints, tmp_path):
    path = with_mtp(checkpoints["deepseek_v3"], tmp_path / "ckpt", own_tables=False, drop=(drop,))
    with pytest.raises(ValueError, match=rf"missing: {drop.replace('.', '[.]')}$"):
        load_model(path, torch.float32, "cpu", mtp=True)
    load_model(path, torch.float32, "cpu")  # without the MTP module its tensors are not read


def test_mtp_requests_that_cannot_be_met_are_refused(checkpoints, tmp_path):
    bare = with_mtp(checkpoints["deepseek_v3"], tmp_path / "bare", own_tables=False, tensors=False)
    with pytest.raises(ValueError, match=r"holds no tensor of MTP layer model\.layers\.3 "):
        load_model(bare, torch.float32, "cpu", mtp=True)
    none = tmp_path / "none"
    shutil.copytree(checkpoints["deepseek_v3"], none)
    cfg = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="no MTP layers"):
        load_model(none, torch.float32, "cpu", mtp=True)
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM has no multi-token-prediction"):
        load_model(checkpoints["deepseek_v2"], torch.float32, "cpu", mtp=True)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no multi-token-prediction"):
        load_model(checkpoints["llama"], torch.float32, "cpu", mtp=True)


def test_checkpoint_shapes_name_the_mtp_tensors_as_checkpoints_do(mtp_dir):
    """The way back (benchmarks write random checkpoints from it): the MTP parameters' checkpoint
    names and shapes are the file's, plus the two tables a checkpoint may leave to the main model."""
    from safetensors import safe_open

    from models.arch import ModelArch
    from models.loader.safetensors import build_on_meta, checkpoint_shapes

    shapes = checkpoint_shapes(build_on_meta(ModelArch.from_dir(mtp_dir), torch.float32, mtp=True))
    with safe_open(str(mtp_dir / "model.safetensors"), framework="pt") as f:
        stored = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if n.startswith(MTP)}
    tables = {MTP + "embed_tokens.weight": (VOCAB, HIDDEN), MTP + "shared_head.head.weight": (VOCAB, HIDDEN)}
    assert {n: s for n, s in shapes.items() if n.startswith(MTP)} == {**stored, **tables}
    assert not any(n.startswith("mtp.") for n in shapes)
