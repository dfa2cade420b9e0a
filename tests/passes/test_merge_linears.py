import pytest
import torch
from pass_helpers import apply, arch, assert_same, capture, ops, run
from torch import nn

from atomc.passes.merge_linears import MergeLinears
from models.layers import RotaryEmbedding, SiluAndMulMLP
from models.llama import Attention


class QKV(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 32, bias=bias), nn.Linear(16, 8, bias=bias), nn.Linear(16, 8, bias=bias)
        self.gate, self.up = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)

    def forward(self, x, y):
        return self.q(x), self.k(x), self.v(x) * 2, self.gate(y) * self.up(y)


class _Flat(torch.fx.Tracer):
    def is_leaf_module(self, m, name):
        return False  # trace into nn.Linear: F.linear on get_attr weights


def flat_trace(module):
    return torch.fx.GraphModule(module, _Flat().trace(module))


@pytest.mark.parametrize("bias", [False, True])
def test_graph_merge_of_constant_weights(bias):
    gm = flat_trace(QKV(bias))  # weights are get_attr constants here
    inputs = [torch.randn(5, 16), torch.randn(5, 16)]
    assert ops(gm)["linear"] == 5
    result, after = apply(MergeLinears(), gm)
    assert (result.matched, result.rewritten) == (2, 2)
    counts = ops(after)
    assert counts["linear"] == 2 and counts["method.split"] == 2  # q/k/v 3 -> 1, gate/up 2 -> 1
    assert_same(run(gm, inputs), run(after, inputs))


def test_dynamo_graph_weights_are_inputs_so_only_counted():
    gm, inputs = capture(QKV(False), torch.randn(5, 16), torch.randn(5, 16))
    result, after = apply(MergeLinears(), gm)
    assert (result.matched, result.rewritten) == (2, 0) and ops(after)["linear"] == 5


@pytest.mark.parametrize("bias", [False, True])
def test_load_time_merge_keeps_outputs(bias):
    torch.manual_seed(0)
    a = arch(qkv_bias=bias)
    attn, mlp = Attention(a, 0), SiluAndMulMLP(a.hidden_size, a.intermediate_size, bias)
    # the unmerged default keeps the Hugging Face parameter names the loader fills
    assert {"q_proj.weight", "k_proj.weight", "v_proj.weight"} <= set(attn.state_dict())
    assert {"gate_proj.weight", "up_proj.weight"} <= set(mlp.state_dict())
    model = nn.ModuleDict({"attn": attn, "mlp": mlp})
    x, positions = torch.randn(6, a.hidden_size), torch.arange(6)
    rope = RotaryEmbedding(a.head_dim, 32, 10000.0, None)
    with torch.no_grad():
        ref = attn(positions, x, rope), mlp(x)
        assert MergeLinears().transform_module(model) == 2
        assert MergeLinears().transform_module(model) == 0  # idempotent: already merged
        got = attn(positions, x, rope), mlp(x)
    assert not hasattr(attn, "q_proj") and attn.qkv_proj.weight.shape == (64 + 2 * 32, 64)
    assert (attn.qkv_proj.bias is not None) == bias
    assert mlp.gate_up_proj.weight.shape == (2 * a.intermediate_size, a.hidden_size)
    assert_same(ref, got, atol=1e-6, rtol=1e-6)


def test_merged_model_traces_to_one_gemm_per_group():
    a = arch()
    attn = Attention(a, 0)
    rope = RotaryEmbedding(a.head_dim, 32, 10000.0, None)
    attn.merge_qkv()
    gm, _ = capture(lambda p, x: attn(p, x, rope), torch.arange(5), torch.randn(5, a.hidden_size))
    assert ops(gm)["linear"] == 2  # qkv_proj + o_proj
