"""The Llama-style attention block the dense families share (Llama, Mistral, Qwen2, Qwen3, Phi-3)
and MoE families will reuse: one qkv GEMM, optional q/k RMSNorm, RoPE, atomc::attention, o_proj.

This is the one place a model calls torch.ops.atomc.attention. The op finds the layer's paged KV
cache by `layer_idx` in the forward context, so the traced graph captures no cache tensor.
Heads are this rank's (QKVParallelLinear splits them); o_proj sums the ranks' partial outputs.
`sinks=True` (GPT-OSS) adds a learned sink logit per head, `sinks` [this rank's heads], passed to
the op; without it the op is called exactly as before (the dense families' graphs do not change).
"""

from __future__ import annotations

import torch
from torch import nn

import atomc.ops  # noqa: F401  (registers torch.ops.atomc.*)
from models.layers.linear import QKVParallelLinear, RowParallelLinear
from models.layers.norm import RMSNorm
from models.layers.parallel import SINGLE, ParallelInfo
from models.layers.rotary import RotaryEmbedding
from models.quant.base import set_weight_attrs


class LlamaStyleAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        sliding_window: int = 0,
        sinks: bool = False,
        parallel: ParallelInfo = SINGLE,
        linear_method=None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window  # tokens; 0: full attention
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias, parallel, linear_method
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, o_bias, parallel, linear_method)
        self.qk_norm = qk_norm_eps is not None
        if self.qk_norm:  # Qwen3: RMSNorm over each head's q and k before RoPE
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        if sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            set_weight_attrs(self.sinks, {"weight_loader": self._load_sinks})
        else:
            self.register_parameter("sinks", None)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's heads of the checkpoint's [num_heads] sinks (heads split as q's are)."""
        n, rank = self.num_heads, self.qkv_proj.parallel.rank
        if loaded.dim() != 1 or loaded.shape[0] != n * self.qkv_proj.parallel.size:
            raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects ({n * self.qkv_proj.parallel.size},)")
        with torch.no_grad():
            param.copy_(loaded[rank * n : (rank + 1) * n])

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.local_output_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        out = torch.empty_like(q)
        if self.sinks is None:
            torch.ops.atomc.attention(q, k, v, out, self.layer_idx, self.scale, self.sliding_window)
        else:
            torch.ops.atomc.attention(q, k, v, out, self.layer_idx, self.scale, self.sliding_window, self.sinks)
        return self.o_proj(out.view(t, self.num_heads * self.head_dim))
