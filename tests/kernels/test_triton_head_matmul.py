"""atomc::head_matmul's one-token Triton kernels (atomc/kernels/triton/head_matmul.py) against the
op's bmm reference through the Triton interpreter (fp32 and fp16: the interpreter mishandles bf16):
both weight layouts, taken as the strided per-head slices DeepSeek's layer hands them (q_nope a slice
of q's heads, W_UK / W_UV slices of kv_b_proj's weight), widths that leave tiles partly masked, and
the fallbacks (more tokens, the switch off)."""

import importlib

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import

triton = pytest.importorskip("triton")

from atomc.ops.head_matmul import head_matmul_reference  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def kernel_module():
    return importlib.import_module("atomc.kernels.triton.head_matmul")


def layer_inputs(t, heads, nope, v, lora, rope, dtype, seed=0):
    """q_nope [T, H, nope] as a slice of q [T, H, nope + rope]; W_UK [H, nope, lora] and W_UV
    [H, v, lora] as slices of kv_b_proj's weight [H * (nope + v), lora], as models/deepseek.py has them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, nope + rope, generator=g).to(dtype)
    kv_b = (torch.randn(heads * (nope + v), lora, generator=g) / lora**0.5).to(dtype)
    w = kv_b.view(heads, nope + v, lora)
    attn_out = torch.randn(t, heads, lora, generator=g).to(dtype)
    return q[..., :nope], w[:, :nope], w[:, nope:], attn_out


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# many_heads: past FEW_HEADS, so the other default tiles
SHAPES = {"uneven": (3, 24, 20, 40), "v2_lite": (16, 128, 128, 512), "many_heads": (40, 24, 20, 72)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,nope,v,lora", SHAPES.values(), ids=SHAPES.keys())
def test_one_token_matches_the_bmm(dtype, heads, nope, v, lora):
    q_nope, w_uk, w_uv, attn_out = layer_inputs(1, heads, nope, v, lora, 8, dtype)
    km = kernel_module()
    for x, w, transpose_w in ((q_nope, w_uk, False), (attn_out, w_uv, True)):
        want = head_matmul_reference(x, w, transpose_w)
        for tiles in ({}, {"block_n": 16, "block_k": 16}):  # the defaults, and tiles that loop and mask
            got = km.head_matmul(x, w, transpose_w, one_row=True, **tiles)
            assert got.shape == want.shape and got.stride() == want.stride()
            assert rel(got, want) < TOL[dtype], (transpose_w, tiles)


def test_more_tokens_and_the_switch_off_run_the_bmm(monkeypatch):
    km = kernel_module()
    monkeypatch.setattr(km, "_rows_kernel", None)  # launching a kernel would fail
    monkeypatch.setattr(km, "_columns_kernel", None)
    q_nope, w_uk, w_uv, _ = layer_inputs(3, 4, 16, 16, 32, 8, torch.float32)
    got = km.head_matmul(q_nope, w_uk, False, one_row=True)
    torch.testing.assert_close(got, head_matmul_reference(q_nope, w_uk, False))
    _, _, _, out1 = layer_inputs(1, 4, 16, 16, 32, 8, torch.float32)
    got = km.head_matmul(out1, w_uv, True, one_row=False)
    torch.testing.assert_close(got, head_matmul_reference(out1, w_uv, True))


def test_the_op_checks_its_shapes():
    x = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="K 16 against w's 8"):
        torch.ops.atomc.head_matmul(x, torch.randn(4, 8, 32), False)
    with pytest.raises(ValueError, match="not"):
        torch.ops.atomc.head_matmul(x, torch.randn(3, 16, 32), False)


@pytest.mark.parametrize("t", [1, 3])
def test_output_layouts_reference_and_fake_agree(t):
    # W_UV's product is token-major (the layer flattens it into o_proj: no copy in a compiled graph),
    # W_UK's keeps bmm's heads-outermost layout; the fake promises what the reference returns
    from torch._subclasses.fake_tensor import FakeTensorMode

    q_nope, w_uk, w_uv, attn_out = layer_inputs(t, 4, 16, 8, 32, 8, torch.float32)
    for x, w, transpose_w in ((q_nope, w_uk, False), (attn_out, w_uv, True)):
        real = torch.ops.atomc.head_matmul(x, w, transpose_w)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = torch.ops.atomc.head_matmul(mode.from_tensor(x), mode.from_tensor(w), transpose_w)
        assert fake.shape == real.shape and fake.stride() == real.stride(), transpose_w
        if transpose_w:
            assert real.is_contiguous() and real.reshape(t, -1).data_ptr() == real.data_ptr()
        else:
            assert real.stride() == (real.shape[2], t * real.shape[2], 1)


def test_flattening_w_uv_heads_copies_nothing_in_a_symbolic_trace():
    # what the compiled DeepSeek layer does with W_UV's product (o_proj's input), at a symbolic token
    # count: a view. W_UK's heads-outermost layout would need a copy (aten.clone) there, which the
    # decode graph ran as a kernel a layer even at one token.
    from torch.fx.experimental.proxy_tensor import make_fx

    _, w_uk, w_uv, attn_out = layer_inputs(3, 4, 16, 8, 32, 8, torch.float32)
    q_nope = torch.randn(3, 4, 16)

    def ops(x, w, transpose_w):
        traced = make_fx(
            lambda a, b: torch.ops.atomc.head_matmul(a, b, transpose_w).reshape(a.shape[0], -1),
            tracing_mode="symbolic",
        )(x, w)
        return {str(n.target) for n in traced.graph.nodes if n.op == "call_function"}

    assert not {"aten.clone.default", "aten._unsafe_view.default"} & ops(attn_out, w_uv, True)
    assert "aten.clone.default" in ops(q_nope, w_uk, False)  # the layout this test guards against
