"""Llama family (Llama 2/3/3.1, Mistral, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm).

Module names equal the Hugging Face parameter names, so checkpoints load without renaming.
"""

from __future__ import annotations

import torch
from torch import nn

import atomc.ops  # noqa: F401  (registers torch.ops.atomc.*)
from models.arch import layer_sliding_window
from models.layers import RMSNorm, RotaryEmbedding, SiluAndMulMLP, merge_linears


class Attention(nn.Module):
    def __init__(self, arch, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.scale = self.head_dim**-0.5
        h, d = arch.hidden_size, arch.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.sliding_window = layer_sliding_window(arch, layer_idx)  # 0: full attention

    def merge_qkv(self) -> bool:
        """After loading: one GEMM for q, k and v (weights and biases concatenated). False if already merged."""
        if hasattr(self, "qkv_proj"):
            return False
        self.qkv_proj = merge_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj
        return True

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        t = x.shape[0]
        if hasattr(self, "qkv_proj"):
            nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([nq, nkv, nkv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        out = torch.empty_like(q)
        torch.ops.atomc.attention(q, k, v, out, self.layer_idx, self.scale, self.sliding_window)
        return self.o_proj(out.view(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, arch, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(arch, layer_idx)
        self.mlp = SiluAndMulMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, arch):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, self.rotary_emb)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch):
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        # moving off the meta device makes new Parameters, so the loader calls this again after it
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch; logits are computed only where needed."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
