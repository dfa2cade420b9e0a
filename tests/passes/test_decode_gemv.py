import torch
from pass_helpers import apply, assert_same, capture, ops, run

from atomc.passes.canonicalize import Canonicalize
from atomc.passes.decode_gemv import DecodeGemv


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 24, bias=True)
        self.down = torch.nn.Linear(24, 16, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def canonical(x):
    gm, inputs = capture(TwoLinears().eval(), x)
    _, canon = apply(Canonicalize(), gm)
    assert ops(canon)["linear"] == 2
    return gm, inputs, canon


def test_cuda_gets_atomc_linear_with_bias_kept():
    for rows in (1, 5):  # one spelling for every batch: the backend picks the kernel per call
        gm, inputs, canon = canonical(torch.randn(rows, 16))
        result, after = apply(DecodeGemv("cuda"), canon)
        assert (result.matched, result.rewritten) == (2, 2)
        counts = ops(after)
        assert counts["atomc.linear"] == 2 and counts["linear"] == 0
        biases = [n.args[2] for n in after.graph.nodes if n.target is torch.ops.atomc.linear.default]
        assert sum(b is not None for b in biases) == 1
        assert_same(run(gm, inputs), run(after, inputs))


def test_other_platforms_keep_f_linear():
    for platform in ("cpu", "rocm"):
        _, _, canon = canonical(torch.randn(3, 16))
        result, after = apply(DecodeGemv(platform), canon)
        assert (result.matched, result.rewritten) == (2, 0) and "kept" in result.notes
        assert ops(after)["linear"] == 2 and ops(after)["atomc.linear"] == 0


def test_uuid_depends_on_platform():
    assert DecodeGemv("cuda").uuid() != DecodeGemv("cpu").uuid()
