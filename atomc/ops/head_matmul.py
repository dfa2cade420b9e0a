"""`atomc::head_matmul`: one small matrix product per attention head, as MLA's absorbed decode runs
two of them a layer (DeepSeek: q_nope times W_UK into the latent, the attention output times W_UV
out of it; models/deepseek.py).

    head_matmul(x [T, H, K], w, transpose_w) -> [T, H, N]
      out[t, h] = x[t, h] @ w[h]        w [H, K, N]   (transpose_w False: W_UK)
      out[t, h] = x[t, h] @ w[h].T      w [H, N, K]   (transpose_w True: W_UV)

The reference is torch.bmm over the head axis. `x` and `w` may be strided views (q_nope is a slice
of q's heads, W_UK and W_UV are per-head slices of kv_b_proj's weight); each row of the last
dimension must be contiguous. An op rather than a bmm in the model, so a backend can run the
one-token case (batch-1 decode) on its own kernel (atomc/kernels/triton/head_matmul.py).

The output's layout is part of the contract (`head_matmul_out`): W_UV's product (transpose_w) is
token-major and contiguous, since the layer flattens its heads into o_proj's input, and a compiled
graph would otherwise copy it there (a kernel a layer, even at one token, where the shapes are
symbolic); W_UK's keeps bmm's heads-outermost layout, which the attention kernel reads through
its strides, so many tokens pay no copy.
"""

from __future__ import annotations

import torch


def head_matmul_reference(x: torch.Tensor, w: torch.Tensor, transpose_w: bool) -> torch.Tensor:
    """The op's body as a plain function (a backend's fallback calls it without dispatching)."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0]:
        raise ValueError(f"head_matmul: x {tuple(x.shape)} and w {tuple(w.shape)} are not [T, H, K] and [H, ., .]")
    w_kn = w.transpose(1, 2) if transpose_w else w
    if w_kn.shape[1] != x.shape[2]:
        raise ValueError(f"head_matmul: x's K {x.shape[2]} against w's {w_kn.shape[1]}")
    y = torch.bmm(x.transpose(0, 1), w_kn).transpose(0, 1)
    # W_UV's: copied into the token-major layout, its strides exactly the fake's (one token too)
    return head_matmul_out(x, w, transpose_w).copy_(y) if transpose_w else y


def head_matmul_out(x: torch.Tensor, w: torch.Tensor, transpose_w: bool) -> torch.Tensor:
    """An uninitialised output in the layout every backend returns: [T, H, N], token-major and
    contiguous for transpose_w (W_UV), else bmm's, heads outermost (strides (N, T * N, 1))."""
    t, h, n = x.shape[0], x.shape[1], w.shape[1] if transpose_w else w.shape[2]
    if transpose_w:
        return x.new_empty((t, h, n))
    return x.new_empty_strided((t, h, n), (n, t * n, 1))


@torch.library.custom_op("atomc::head_matmul", mutates_args=())
def head_matmul(x: torch.Tensor, w: torch.Tensor, transpose_w: bool) -> torch.Tensor:
    return head_matmul_reference(x, w, transpose_w)


@head_matmul.register_fake
def _(x, w, transpose_w):
    return head_matmul_out(x, w, transpose_w)
