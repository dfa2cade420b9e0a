"""`atomc_aiter::mla_attention` against the `atomc::mla_attention` reference, through the stand-in
`aiter` (keyword-only, AITER's argument names, asserting its shapes and dtypes): decode through
`mla_decode_fwd`, prefill, chunked prefill over a cached prefix and mixed batches through
`mla_prefill_fwd`, the latent write through `concat_and_cache_mla`, over scattered pages with
padding rows; what AITER's MLA kernels do not take goes to ROCm's next backend; the lowering on a
faked ROCm platform. CPU only: none of this has run on AMD hardware."""

from __future__ import annotations

import fake_aiter
import pytest
import torch
import torch.nn.functional as F
from triton_kernel_cases import make_batch

from atomc.forward_context import ForwardContext, set_forward_context
from atomc.kernels import registry

KV_LORA, ROPE, HEADS, PAGE = 512, 64, 16, 16
SCALE = 0.07

BATCHES = {  # (query lengths, context lengths after this step)
    "decode": ([1, 1, 1], [5, 37, 16]),
    "prefill": ([7, 20], [7, 20]),
    "chunked_prefill_over_a_prefix": ([5, 3], [21, 40]),
    "mixed": ([1, 9, 1], [33, 9, 2]),
}


@pytest.fixture
def aiter_mla(monkeypatch):
    fake_aiter.install(monkeypatch)
    # ROCm without Triton: the next backend after AITER is the reference (as on this CPU)
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend != "triton")
    registry.lookup("mla_attention", "aiter")  # defines torch.ops.atomc_aiter.mla_attention, sets its fallback
    return torch.ops.atomc_aiter.mla_attention


def mla_batch(case, dtype=torch.bfloat16, heads=HEADS, kv_lora=KV_LORA, rope=ROPE, seed=0):
    """(q_absorbed, q_pe, c_kv, k_pe, latent cache with the prefixes in it, metadata); 2 padding rows."""
    q_lens, seq_lens = BATCHES[case]
    q, latent, _, meta = make_batch(q_lens, seq_lens, heads, 1, kv_lora + rope, dtype, "cpu", page=PAGE, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    latent_new = torch.randn(q.shape[0], kv_lora + rope, generator=g).to(dtype)
    c_kv, k_pe = latent_new[:, :kv_lora], latent_new[:, kv_lora:]  # c_kv's rows stride past it, as the model's
    return q[..., :kv_lora], q[..., kv_lora:].contiguous(), c_kv, k_pe.contiguous(), latent, meta


def run(op, q_absorbed, q_pe, c_kv, k_pe, latent, meta, out=None):
    """(out, cache after the step) of `op` on its own copy of the cache."""
    cache = latent.clone()
    out = torch.full(q_absorbed.shape, float("nan"), dtype=q_absorbed.dtype) if out is None else out
    with set_forward_context(ForwardContext(meta, [(cache, cache[..., : q_absorbed.shape[-1]])])):
        op(q_absorbed, q_pe, c_kv, k_pe, out, 0, SCALE)
    return out, cache


@pytest.mark.parametrize("case", list(BATCHES))
def test_matches_the_reference(aiter_mla, case):
    args = mla_batch(case)
    got, got_cache = run(aiter_mla, *args)
    calls = list(fake_aiter.CALLS)
    want, want_cache = run(torch.ops.atomc.mla_attention, *args)
    rows = int(args[-1].query_start_loc[-1])  # padding rows after them are the kernels' to leave
    torch.testing.assert_close(got[:rows].float(), want[:rows].float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(got_cache, want_cache)
    entry = "mla_decode_fwd" if max(BATCHES[case][0]) == 1 else "mla_prefill_fwd"
    assert calls == ["concat_and_cache_mla", entry]


def test_the_new_latent_is_what_is_attended(aiter_mla):
    """A change to one new token's latent must change the output (the write happens before the read)."""
    q_absorbed, q_pe, c_kv, k_pe, latent, meta = mla_batch("chunked_prefill_over_a_prefix")
    a, _ = run(aiter_mla, q_absorbed, q_pe, c_kv, k_pe, latent, meta)
    c_kv2 = c_kv.clone()
    c_kv2[0] += 3.0
    b, _ = run(aiter_mla, q_absorbed, q_pe, c_kv2, k_pe, latent, meta)
    assert (a[:5].float() - b[:5].float()).abs().max() > 1e-2  # sequence 0's rows see token 0
    torch.testing.assert_close(a[5:8], b[5:8])  # sequence 1's do not


def test_a_strided_output_is_written_in_place(aiter_mla):
    args = mla_batch("decode")
    buffer = torch.zeros(args[0].shape[0], HEADS, 2 * KV_LORA, dtype=torch.bfloat16)
    out = buffer[..., :KV_LORA]
    got, _ = run(aiter_mla, *args, out=out)
    want, _ = run(torch.ops.atomc.mla_attention, *args)
    torch.testing.assert_close(got[:3].float(), want[:3].float(), atol=2e-2, rtol=2e-2)
    assert got.data_ptr() == buffer.data_ptr() and not buffer[:3, :, KV_LORA:].any()


def test_token_indices_follow_the_block_table():
    from atomc.kernels.aiter.mla import token_indices

    *_, meta = mla_batch("mixed")
    meta.block_tables = F.pad(meta.block_tables, (0, 5))  # a runner's table is wider than the batch needs
    kv_indptr, kv_indices = token_indices(meta, PAGE)
    assert kv_indptr.tolist() == [0, 33, 42, 44] and kv_indptr.dtype == kv_indices.dtype == torch.int32
    assert kv_indices.numel() == 3 * 48  # num_seqs x max_seq_len (33) in whole pages: a host bound, no sync
    for i, length in enumerate(meta.seq_lens.tolist()):
        want = [int(meta.block_tables[i, p // PAGE]) * PAGE + p % PAGE for p in range(length)]
        assert kv_indices[int(kv_indptr[i]) : int(kv_indptr[i + 1])].tolist() == want


@pytest.mark.parametrize(
    "case",
    [dict(dtype=torch.float16), dict(dtype=torch.float32), dict(heads=4), dict(kv_lora=32, rope=8)],
    ids=["float16", "float32", "4_heads", "small_widths"],
)
def test_what_aiter_cannot_run_goes_to_the_next_backend(aiter_mla, case):
    args = mla_batch("mixed", **case)
    got, got_cache = run(aiter_mla, *args)
    want, want_cache = run(torch.ops.atomc.mla_attention, *args)
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got_cache, want_cache)
    assert fake_aiter.CALLS == []


def test_without_a_cache_the_next_backend_runs(aiter_mla):
    q_absorbed, q_pe, c_kv, k_pe, *_ = mla_batch("prefill")
    got, want = torch.empty_like(q_absorbed), torch.empty_like(q_absorbed)
    aiter_mla(q_absorbed, q_pe, c_kv, k_pe, got, 0, SCALE)
    torch.ops.atomc.mla_attention(q_absorbed, q_pe, c_kv, k_pe, want, 0, SCALE)
    assert torch.equal(got, want) and fake_aiter.CALLS == []


def test_stand_in_refuses_what_aiter_refuses(monkeypatch):
    mod = fake_aiter.install(monkeypatch)
    q = torch.randn(3, HEADS, KV_LORA + ROPE).bfloat16()
    kv = torch.randn(40, 1, 1, KV_LORA + ROPE).bfloat16()
    i32 = dict(dtype=torch.int32)
    ok = dict(q=q, kv_buffer=kv, o=torch.empty(3, HEADS, KV_LORA, dtype=torch.bfloat16),
              qo_indptr=torch.tensor([0, 1, 2, 3], **i32), kv_indptr=torch.tensor([0, 4, 9, 20], **i32),
              kv_indices=torch.arange(20, **i32), kv_last_page_lens=torch.ones(3, **i32), max_seqlen_q=1)  # fmt: skip
    mod.mla.mla_decode_fwd(**ok)
    mod.mla.mla_prefill_fwd(**ok)
    for bad in (dict(kv_indptr=ok["kv_indptr"].long()), dict(q=q.half()), dict(kv_buffer=kv.view(40, 1, 576)),
                dict(q=torch.randn(3, HEADS, 2 * (KV_LORA + ROPE)).bfloat16()[..., ::2]), dict(logit_cap=30.0),
                dict(kv_indices=torch.arange(10, dtype=torch.int32))):  # fmt: skip
        with pytest.raises(AssertionError):
            mod.mla.mla_decode_fwd(**{**ok, **bad})
    with pytest.raises(AssertionError):  # the prefill kernels exist for 16 and 128 heads only
        mod.mla.mla_prefill_fwd(**{**ok, "q": q[:, :8].contiguous(), "o": ok["o"][:, :8].contiguous()})
    with pytest.raises(TypeError):
        mod.mla.mla_decode_fwd(*ok.values())  # positional


def test_rocm_lowers_mla_attention_to_aiter(monkeypatch):
    """A traced graph's atomc::mla_attention becomes atomc_aiter::mla_attention on ROCm."""
    from atomc.passes.lowering import Lowering

    fake_aiter.install(monkeypatch)
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend != "triton")
    assert registry.choose("mla_attention", "rocm") == ("aiter", torch.ops.atomc_aiter.mla_attention.default)
    assert "atomc.kernels.aiter.mla" in registry.chosen_modules("rocm")
    assert "atomc_aiter::mla_attention" in registry.splitting_op_names()  # a context op: the graph is cut here

    def f(q_absorbed, q_pe, c_kv, k_pe, out):
        torch.ops.atomc.mla_attention(q_absorbed, q_pe, c_kv, k_pe, out, 0, SCALE)
        return out

    gm = torch.fx.symbolic_trace(f)
    result = Lowering("rocm")(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.atomc_aiter.mla_attention.default] and result.rewritten == 1
    monkeypatch.setattr(registry, "backend_available", lambda backend: True)
    assert registry.choose_backend("mla_attention", "rocm") == "aiter"  # before Triton's MLA kernel
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend == "torch")
    assert registry.choose("mla_attention", "rocm")[0] == "torch"
