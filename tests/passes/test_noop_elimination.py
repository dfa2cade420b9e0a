import torch
from pass_helpers import apply, assert_same, capture, ops, run

from atomc.passes.noop_elimination import NoopElimination


def f(x, y):
    a = x.float()  # fp32 already
    a = a.view(x.shape[0], 8)  # same shape
    a = a.contiguous()
    a = a[:, :]
    a = a.to(torch.float32)
    a = a.reshape(x.shape) * 2
    b = y.to(torch.float16).float()  # real casts: kept
    c = x.view(-1, 2, 4)  # changes the shape: kept
    d = x.t().contiguous()  # not contiguous before: kept
    return a + b, c, d, x[1:]  # a partial slice: kept


def test_removes_only_noops_and_keeps_numbers():
    x, y = torch.randn(5, 8), torch.randn(5, 8)
    gm, inputs = capture(f, x, y)
    before = ops(gm)
    result, after_gm = apply(NoopElimination(), gm)
    after = ops(after_gm)
    assert result.rewritten == result.matched == 6
    assert result.notes == "cast=2, contiguous=1, slice=1, view=2"
    assert before["method.float"] == 2 and after["method.float"] == 1  # the one after .to(float16)
    assert before["method.to"] == 2 and after["method.to"] == 1  # .to(float16)
    assert after["method.view"] == 1 and after["method.reshape"] == 0
    assert after["method.contiguous"] == 1  # on x.t()
    assert after["getitem"] == 1  # x[1:]
    assert_same(run(gm, inputs), run(after_gm, inputs))


def test_low_precision_casts_stay():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    gm, _ = capture(lambda t: t.float() * 2, x)
    result, after_gm = apply(NoopElimination(), gm)
    assert result.matched == 0 and ops(after_gm)["method.float"] == 1
