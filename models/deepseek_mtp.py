"""DeepSeek-V3/R1's multi-token-prediction (MTP) module: the draft head a speculative-decoding step
calls after the main model, loaded from the checkpoint's layers after the last.

A V3/R1 checkpoint holds `num_nextn_predict_layers` MTP layers (1 in the released weights) as
`model.layers.{N + k}.*`, N = num_hidden_layers. Each has `enorm` and `hnorm` (RMSNorms of the
hidden size), `eh_proj` (hidden x 2*hidden, no bias), a full decoder layer (`self_attn`, `mlp`,
`input_layernorm`, `post_attention_layernorm`: MLA and a DeepSeek MoE, like the main model's
sparse layers), `shared_head.norm`, `shared_head.head` and `embed_tokens`. Here the decoder layer
is the module's `block` (so `model.layers.{N + k}.self_attn.*` loads into `mtp.{k}.block.self_attn.*`:
`checkpoint_prefixes` below tells the loader), the rest keep their names.

For the row of position t, given h_t (the main model's hidden state there) and token t+1:

    e = embed_tokens(token t+1), zeroed where t == 0
    x = eh_proj(cat([enorm(e), hnorm(h_t)], -1))        # the embedding's half first
    y = shared_head.norm(block(t, x))                     # block: MLA (its own latent cache) + MoE
    logits = shared_head.head(y)                          # a guess at token t+2

Where each fact comes from (the V3 technical report states the design, not these details, and
DeepSeek's own inference code in the DeepSeek-V3 repository has no MTP forward):
- The tensor names, that the MTP layers follow the main layers' ids, and that `embed_tokens` and
  `shared_head.head` share the main model's parameters: DeepSeek-V3's weight documentation
  (README_WEIGHTS.md in the DeepSeek-V3 repository).
- The concat order (the normalised embedding first, then the normalised hidden state; the name
  eh_proj reads the same way), enorm on the embedding and hnorm on the hidden state, the decoder
  layer on the projection, then shared_head.norm and shared_head.head: vLLM (deepseek_mtp.py) and
  SGLang (deepseek_nextn.py) agree. The technical report's formula writes the two halves the other
  way round; the released weights go with the implementations.
- h_t is the main model's output AFTER its final norm (what atomc's `forward` returns): vLLM's and
  SGLang's DeepSeek models hand the drafter their normalised output, and ATOM's fix for chained
  drafts (ROCm/ATOM pull request 1764) cites DeepSeek's own modeling_deepseek.py shipped with an
  MTP checkpoint for this. A second draft step from this module feeds it its own `y` (after
  shared_head.norm, the same ATOM and vLLM fixes).
- The embedding is zeroed at position 0: vLLM and ATOM (deepseek_mtp.py) do so.
- The block runs at the positions of the main model's rows (t, not t+1): vLLM passes the target's
  positions to the drafter.

Where the checkpoint lacks a layer's `embed_tokens` or `shared_head.head`, that layer shares the
main model's Parameter (no memory); where it has them, they load as the layer's own (DeepSeek's
checkpoints store copies: a V3 MTP layer then holds two more vocab x 7168 tables).
"""

from __future__ import annotations

import torch
from torch import nn

from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layers.linear import ReplicatedLinear
from models.layers.norm import RMSNorm
from models.layers.parallel import SINGLE, ParallelInfo
from models.layers.rotary import RotaryEmbedding
from models.quant.fp8 import FP8BlockLinearMethod
from models.quant.unquantized import UnquantizedLinearMethod

# an MTP layer's own modules (the checkpoint names them as they are named here); the rest of
# `model.layers.{N + k}` is its decoder layer
MTP_OWN_MODULES = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float, parallel: ParallelInfo = SINGLE):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = ParallelLMHead(vocab_size, hidden_size, parallel)


class MTPLayer(nn.Module):
    """One MTP depth around `block` (a decoder layer whose attention has its own KV layer index)."""

    def __init__(
        self, block: nn.Module, vocab_size: int, hidden_size: int, eps: float, parallel: ParallelInfo = SINGLE
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size, parallel)
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = ReplicatedLinear(2 * hidden_size, hidden_size, False, parallel)
        self.block = block
        self.shared_head = SharedHead(hidden_size, vocab_size, eps, parallel)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, rope: RotaryEmbedding
    ) -> torch.Tensor:
        """input_ids [T]: the tokens after each row's position; positions [T]; hidden [T, H]: the
        main model's output at those positions (or the previous depth's). -> [T, H] after
        shared_head.norm: what compute_logits takes and what a next depth takes as `hidden`."""
        e = self.embed_tokens(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(self.block(positions, x, rope))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head.compute_logits(hidden)


def checkpoint_prefixes(num_layers: int, num_mtp: int) -> tuple[tuple[str, str], ...]:
    """(checkpoint prefix, parameter prefix) pairs for the MTP layers of a model with `num_layers`
    main layers, whose MTP modules sit in `mtp` (the loader takes the longest match)."""
    pairs = []
    for k in range(num_mtp):
        src = f"model.layers.{num_layers + k}."
        pairs += [(f"{src}{m}.", f"mtp.{k}.{m}.") for m in MTP_OWN_MODULES]
        pairs.append((src, f"mtp.{k}.block."))
    return tuple(pairs)


def share_absent_tables(model: nn.Module, names: set[str] | None) -> None:
    """Tie each MTP layer's embed_tokens / shared_head.head to the main model's when the checkpoint
    (`names`; None: no checkpoint, random weights) does not store the layer's own. Runs on the meta
    model, before the loader materialises it, so a shared table is never allocated twice."""
    n = model.arch.num_layers
    for k, layer in enumerate(model.mtp):
        prefix = f"model.layers.{n + k}."
        if names is not None and not any(name.startswith(prefix) for name in names):
            raise ValueError(
                f"the checkpoint holds no tensor of MTP layer {prefix.rstrip('.')} "
                f"(config.json: num_nextn_predict_layers = {len(model.mtp)}); load it without the MTP module"
            )
        if names is None or prefix + "embed_tokens.weight" not in names:
            layer.embed_tokens.weight = model.model.embed_tokens.weight
        if names is None or prefix + "shared_head.head.weight" not in names:
            layer.shared_head.head.weight = model.lm_head.weight


def keep_dense_eh_proj(model: nn.Module, names: set[str] | None) -> None:
    """Under a block-FP8 checkpoint each MTP layer's eh_proj is quantised only where the checkpoint
    holds its `weight_scale_inv`: DeepSeek-V3/R1 store it bf16 (the rest of the layer in FP8), some
    re-quantised copies in FP8. No checkpoint (dummy weights): dense, as the released ones. Runs on
    the meta model, after the loader chose the methods (online FP8, which quantises at load, stays)."""
    n = model.arch.num_layers
    for k, layer in enumerate(model.mtp):
        if not isinstance(layer.eh_proj.linear_method, FP8BlockLinearMethod):
            continue
        if names is None or f"model.layers.{n + k}.eh_proj.weight_scale_inv" not in names:
            with torch.device("meta"):
                layer.eh_proj.set_linear_method(UnquantizedLinearMethod())
            getattr(model, "quant_schemes", {}).pop(f"mtp.{k}.eh_proj", None)
