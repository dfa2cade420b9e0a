"""DeepSeek-V2 and DeepSeek-V3 (and R1, which is V3's architecture): multi-head latent attention
over a latent KV cache, and a MoE with DeepSeek's routing and shared experts.

Attention (MLA). q comes from `q_proj`, or through a low-rank pair `q_a_proj` -> RMSNorm ->
`q_b_proj` when `q_lora_rank` is set (V3; V2-Lite has none); per head it splits into a no-rope part
(qk_nope_head_dim) and a rope part (qk_rope_head_dim). `kv_a_proj_with_mqa` gives the latent c_kv
(kv_lora_rank, RMS-normalised) and one rope'd key k_pe shared by the heads; only these two are
cached (atomc/kv_spec.py: MLAAttentionSpec). `kv_b_proj` [H x (nope + v), kv_lora] holds per head
W_UK (its first nope rows) and W_UV (the v rows after): the layer folds W_UK into q and applies
W_UV after atomc::mla_attention, which attends in latent space (atomc/ops/mla.py). The two halves
are views of the loaded weight, so the checkpoint loads as it is. `q_a_proj` (or `q_proj`) and
`kv_a_proj_with_mqa` read the same hidden state, so they run as one GEMM, `qkv_a_proj`: the loader
writes each checkpoint tensor into its section (q's rows first), and its output splits into q's
input, c_kv and k_pe. Without q LoRA, `attention_bias` is refused (q_proj has no bias to merge).

RoPE: DeepSeek's checkpoints pair rope dims as (0, 1), (2, 3), ... (V2's complex rotation; V3's
`rope_interleave`, on by default). Gathering the even then the odd dims turns that into the
rotate-half form RotaryEmbedding computes, with the same q_pe . k_pe, so the cache and the op hold
the de-interleaved order. With YaRN the softmax scale is (nope + rope)^-0.5 times
mscale(factor, mscale_all_dim)^2, and the rope table itself carries YaRN's attention factor
(models/layers/rotary.py).

MoE. Layers from `first_k_dense_replace` on are sparse (transformers reads no `moe_layer_freq`:
a config with one other than 1 is refused). Routing is atomc::moe's (atomc/ops/moe.py:
select_experts): V2 softmax scores, top-k without renormalising (`topk_method` greedy, or
group_limited_greedy: the best `topk_group` of `n_group` groups by their best score); V3 sigmoid
scores, `e_score_correction_bias` added to choose (not to weigh), groups scored by their best two,
renormalised when `norm_topk_prob`. Both scale the weights by `routed_scaling_factor`, and add
`n_shared_experts` shared experts (one gated MLP of moe_intermediate_size * n_shared_experts): a
GatedMLP beside the MoE op, or, with FUSE_SHARED_EXPERTS, n_shared_experts more experts inside it.

The layer, model and causal-LM shell are the shared decoder's (models/decoder.py): this family
supplies its config, MLAAttention, DeepseekMoE or the dense GatedMLP per layer, and the RoPE table
of the rope dims.

MTP. V3/R1 checkpoints add `num_nextn_predict_layers` MTP layers after the last. By default the
loader skips their tensors and nothing is allocated for them; built with `mtp=True`
(models/loader: load_model(..., mtp=True)) the model holds them as `mtp` (models/deepseek_mtp.py),
a draft head a speculative-decoding step calls through `mtp_forward` / `mtp_compute_logits`, each
with a latent cache of its own (layer index num_hidden_layers + k in `kv_cache_specs`).

atomc::mla_attention runs its Triton kernel on NVIDIA GPUs (CUDA graphs then capture it), AITER's
MLA kernels on ROCm (never run on AMD hardware) and its torch reference on the CPU.

FP8. DeepSeek-V3/R1's block-FP8 checkpoints (`quant_method: fp8` with `weight_block_size`) load
through the generic path (models/loader/quantize.py): every linear gets FP8BlockLinearMethod except
the router (`router`: stored dense) and kv_b_proj (`dense_weight`: absorbed_weights reads it into
atomc::head_matmul, so it is dequantised at load into the model dtype, or left dense under online FP8); the
routed experts get Fp8MoEMethod. Other `quantization_config`s are refused at parsing, naming it.

Not here yet: the speculative-decoding loop that would use the MTP module, tensor parallelism (the
layers split heads, but the all-reduce is not there: sizes > 1 are refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

import atomc.ops  # noqa: F401  (registers torch.ops.atomc.mla_attention, moe)
from atomc.kv_spec import MLAAttentionSpec
from atomc.ops.mla_latent import deinterleave
from models.arch import ModelArch
from models.decoder import DecoderForCausalLM, required, stage_kv_specs
from models.deepseek_mtp import MTPLayer, checkpoint_prefixes, keep_dense_eh_proj, share_absent_tables
from models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from models.layers.mlp import GatedMLP
from models.layers.moe import ExpertNames, FusedMoE, MoESpec, expert_sharding
from models.layers.norm import RMSNorm
from models.layers.parallel import SINGLE, ParallelInfo, all_reduce
from models.layers.rotary import RotaryEmbedding, rope_parameters

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm use RMSNorm's default eps, not rms_norm_eps


@dataclass(frozen=True)
class DeepseekConfig:
    arch: ModelArch
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    rms_norm_eps: float
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_theta: float
    rope_scaling: dict | None
    rope_interleave: bool
    softmax_scale: float
    moe: MoESpec
    moe_layers: frozenset[int]  # main and MTP layer indices whose MLP is sparse
    shared_intermediate_size: int  # 0: no shared experts
    correction_bias: bool  # V3's e_score_correction_bias
    num_mtp_layers: int = 0  # V3's num_nextn_predict_layers: MTP layers after the last (0 for V2)


def softmax_scale(qk_head_dim: int, scaling: dict | None) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN with mscale_all_dim set."""
    scale = qk_head_dim**-0.5
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        all_dim = scaling.get("mscale_all_dim") or 0
        factor = scaling.get("factor") or 1.0
        if all_dim and factor > 1:
            m = 0.1 * all_dim * math.log(factor) + 1.0
            scale *= m * m
    return scale


def _refuse(cond: bool, setting: str, name: str, why: str) -> None:
    if cond:
        raise ValueError(f"{setting} is not supported for {name} ({why})")


def _check_quantization(qc: dict | None, name: str) -> None:
    """DeepSeek-V3/R1's own FP8 layout loads (HF `quant_method: fp8` with `weight_block_size`: block
    weights, activations quantised per token group); other quantised DeepSeek checkpoints are
    refused, their field named (untested with MLA's absorbed kv_b_proj and merged qkv_a_proj)."""
    if qc is None:
        return
    quant = qc.get("quant_method") if isinstance(qc, dict) else None
    _refuse(quant != "fp8", f"quantization_config.quant_method={quant!r}", name,
            "atomc reads DeepSeek's block-FP8 layout: quant_method fp8 with weight_block_size")  # fmt: skip
    block = qc.get("weight_block_size")
    _refuse(block is None, "quantization_config without weight_block_size (per-tensor FP8)", name,
            "atomc reads DeepSeek's block-FP8 layout: quant_method fp8 with weight_block_size")  # fmt: skip


def parse_deepseek_config(arch: ModelArch, version: int) -> DeepseekConfig:
    cfg, name = arch.raw, arch.architecture
    act = cfg.get("hidden_act", "silu")
    _refuse(act != "silu", f"hidden_act={act!r}", name, "atomc's MLPs are silu-gated")
    _check_quantization(cfg.get("quantization_config"), name)
    bias, q_lora = bool(cfg.get("attention_bias", False)), cfg.get("q_lora_rank")
    _refuse(bias and not q_lora, "attention_bias=true without q_lora_rank", name,
            "q_proj has no bias but kv_a_proj_with_mqa has one, and atomc runs the two as one GEMM")  # fmt: skip
    freq = cfg.get("moe_layer_freq", 1)
    _refuse(freq != 1, f"moe_layer_freq={freq}", name, "every layer from first_k_dense_replace on is sparse")
    method = cfg.get("topk_method", "greedy" if version == 2 else "noaux_tc")
    experts = required(cfg, "n_routed_experts", "num_local_experts", "num_experts")
    groups, keep = cfg.get("n_group") or 0, cfg.get("topk_group") or 0
    if version == 2:
        methods = ("greedy", "group_limited_greedy")
        _refuse(method not in methods, f"topk_method={method!r}", name, f"supported: {', '.join(methods)}")
        _refuse(bool(cfg.get("norm_topk_prob")), "norm_topk_prob=true", name, "its router does not renormalise")
        scoring, renormalize = "softmax", False
        if method == "greedy":
            groups = keep = 0
    else:
        _refuse(method != "noaux_tc", f"topk_method={method!r}", name, "supported: noaux_tc")
        func = cfg.get("scoring_func", "sigmoid")
        _refuse(func != "sigmoid", f"scoring_func={func!r}", name, "supported: sigmoid")
        scoring, renormalize = "sigmoid", bool(cfg.get("norm_topk_prob", True))
    if bool(groups) != bool(keep):
        raise ValueError(f"{name} sets only one of n_group / topk_group (grouped routing needs both)")
    moe = MoESpec(
        num_experts=experts,
        top_k=required(cfg, "num_experts_per_tok"),
        intermediate_size=required(cfg, "moe_intermediate_size"),
        scoring=scoring,
        renormalize=renormalize,
        num_expert_group=groups,
        topk_group=keep,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
    )
    theta, scaling = rope_parameters(cfg)
    nope, rope = required(cfg, "qk_nope_head_dim"), required(cfg, "qk_rope_head_dim")
    first_sparse = cfg.get("first_k_dense_replace") or 0
    num_mtp = (cfg.get("num_nextn_predict_layers") or 0) if version == 3 else 0
    return DeepseekConfig(
        arch=arch,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=required(cfg, "kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=required(cfg, "v_head_dim"),
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleave=True if version == 2 else bool(cfg.get("rope_interleave", True)),
        softmax_scale=softmax_scale(nope + rope, scaling),
        moe=moe,
        # the MTP layers' decoder layers are sparse like the main layers from first_sparse on
        moe_layers=frozenset(range(first_sparse, arch.num_layers + num_mtp)),
        shared_intermediate_size=moe.intermediate_size * (cfg.get("n_shared_experts") or 0),
        correction_bias=version == 3,
        num_mtp_layers=num_mtp,
    )


class MLAAttention(nn.Module):
    def __init__(self, c: DeepseekConfig, layer_idx: int, parallel: ParallelInfo = SINGLE):
        super().__init__()
        self.layer_idx, self.c = layer_idx, c
        h, heads = c.hidden_size, c.arch.num_heads
        self.num_heads = parallel.split(heads, "attention heads")
        qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim
        # q_a_proj (or q_proj) and kv_a_proj_with_mqa read the same x: one GEMM (one GEMV launch a
        # layer at decode), q's section first (a whole number of 128-row FP8 blocks in DeepSeek's
        # checkpoints). q_a and kv_a are replicated across ranks, q_proj is split by heads.
        q_a = c.q_lora_rank or heads * qk_head
        self.qkv_a_proj = MergedColumnParallelLinear(
            h,
            [q_a, c.kv_lora_rank + c.qk_rope_head_dim],
            c.attention_bias,
            parallel,
            replicated=(bool(c.q_lora_rank), True),
        )
        self.qkv_a_sections = [self.qkv_a_proj.local_output_sizes[0], c.kv_lora_rank, c.qk_rope_head_dim]
        if c.q_lora_rank:
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, heads * qk_head, False, parallel)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LORA_NORM_EPS)
        kv_b_out = heads * (c.qk_nope_head_dim + c.v_head_dim)  # per head: W_UK's nope rows, then W_UV's v rows
        self.kv_b_proj = ColumnParallelLinear(c.kv_lora_rank, kv_b_out, False, parallel)
        # absorbed_weights reads per-head views of the weight into atomc::head_matmul, so it must be dense:
        # an FP8 checkpoint's is dequantised once at load, online FP8 leaves it alone
        self.kv_b_proj.dense_weight = True
        self.o_proj = RowParallelLinear(heads * c.v_head_dim, h, c.attention_bias, parallel)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora], W_UV [H, v, kv_lora]): views of kv_b_proj's weight, per head."""
        c = self.c
        w = self.kv_b_proj.weight.view(self.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        c, t, heads = self.c, x.shape[0], self.num_heads
        q, c_kv, k_pe = self.qkv_a_proj(x).split(self.qkv_a_sections, dim=-1)
        if c.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.view(t, heads, -1).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        k_pe = k_pe.reshape(t, 1, c.qk_rope_head_dim)
        if c.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = rope(positions, q_pe, k_pe)
        w_uk, w_uv = self.absorbed_weights()
        q_absorbed = torch.ops.atomc.head_matmul(q_nope, w_uk, False)  # [T, H, kv_lora]
        out = q_absorbed.new_empty(t, heads, c.kv_lora_rank)
        torch.ops.atomc.mla_attention(
            q_absorbed, q_pe, c_kv, k_pe.view(t, c.qk_rope_head_dim), out, self.layer_idx, c.softmax_scale
        )
        o = torch.ops.atomc.head_matmul(out, w_uv, True)  # [T, H, v]
        return self.o_proj(o.reshape(t, heads * c.v_head_dim))


def qkv_a_mapping(c: DeepseekConfig) -> dict[str, tuple[str, int]]:
    """The checkpoint's two projections of x -> qkv_a_proj's sections (q first). A model has either
    q_a_proj or q_proj, so the mapping names only its own (the way back to checkpoint names is unique)."""
    q = "q_a_proj" if c.q_lora_rank else "q_proj"
    return {q: ("qkv_a_proj", 0), "kv_a_proj_with_mqa": ("qkv_a_proj", 1)}


class DeepseekRouter(ReplicatedLinear):
    """The router GEMM (`gate.weight`), and V3's `e_score_correction_bias`, kept in fp32 as the
    checkpoints store it (it separates experts whose bf16 scores would tie). Never quantised: FP8
    checkpoints store the gate dense too (no weight_scale_inv)."""

    router = True

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool, parallel: ParallelInfo = SINGLE):
        super().__init__(hidden_size, num_experts, False, parallel)
        if correction_bias:
            bias = torch.empty(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)


# The shared experts as S more experts of the MoE op, which every token runs (atomc/ops/moe.py):
# their weights are read by the expert kernels' launches, not by a GEMM, an activation and a GEMM
# of their own. DeepSeek-V2-Lite batch 1 on an H100, one call, three runs each: 395.0 -> 408.2
# tok/s (docs/performance.md section 25). Off: a GatedMLP beside the op, as the checkpoint has it.
FUSE_SHARED_EXPERTS = True


def fuses_shared_experts(c: DeepseekConfig, parallel: ParallelInfo) -> bool:
    """Whether this model's MoE layers hold their shared experts (not under expert parallelism,
    where each rank holds only its own routed experts)."""
    ep = expert_sharding(parallel)[1]
    return FUSE_SHARED_EXPERTS and c.shared_intermediate_size > 0 and ep.size == 1


class DeepseekMoE(nn.Module):
    def __init__(self, c: DeepseekConfig, parallel: ParallelInfo = SINGLE):
        super().__init__()
        self.gate = DeepseekRouter(c.hidden_size, c.moe.num_experts, c.correction_bias, parallel)
        self.parallel = parallel
        fused = fuses_shared_experts(c, parallel)  # the op runs them (S experts of the routed width)
        spec = replace(c.moe, shared_experts=c.shared_intermediate_size // c.moe.intermediate_size) if fused else c.moe
        self.experts = FusedMoE(c.hidden_size, spec, *expert_sharding(parallel))
        if c.shared_intermediate_size and not fused:
            # partial sums: reduced once with the routed experts' (forward)
            inter = c.shared_intermediate_size
            self.shared_experts = GatedMLP(c.hidden_size, inter, False, parallel, reduce_results=False)
        else:
            self.shared_experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.gate.e_score_correction_bias
        if self.shared_experts is None:  # none, or inside the op
            return self.experts(x, self.gate(x), bias)
        # the routed experts (each rank its experts, or its slice of each) and the tensor-parallel
        # shared experts are partial sums over the same ranks: added first, reduced once
        routed = self.experts.partial_forward(x, self.gate(x), bias)
        return all_reduce(self.parallel, routed + self.shared_experts(x))


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    version = 2
    # atomc::mla_attention's torch reference reads host-side batch lists, which a captured CUDA graph
    # would replay with the capture's lengths: graphs only where a kernel backend (Triton) runs it
    # (atomc/runtime/model_runner.py: captures_cuda_graphs)
    graphs_need_kernels = ("mla_attention",)
    # the dense MLPs' and the shared experts' gate/up -> one GEMM; q_a_proj / q_proj with
    # kv_a_proj_with_mqa -> qkv_a_proj (per model: qkv_a_mapping)
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    expert_names = ExpertNames({"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})

    @classmethod
    def parse_config(cls, arch: ModelArch) -> DeepseekConfig:
        return parse_deepseek_config(arch, cls.version)

    def __init__(self, arch: ModelArch, parallel: ParallelInfo = SINGLE, mtp: bool = False):
        super().__init__(arch, parallel)
        c = self.config
        self.packed_modules_mapping = {**type(self).packed_modules_mapping, **qkv_a_mapping(c)}
        if fuses_shared_experts(c, parallel):  # `mlp.shared_experts.*` load into the MoE op's experts
            self.expert_names = replace(type(self).expert_names, shared="shared_experts")
        if mtp and parallel.stages > 1:
            raise ValueError("DeepSeek's MTP layers are not built under pipeline parallelism")
        if mtp and not c.num_mtp_layers:
            raise ValueError(
                f"{arch.architecture}: this config.json has no MTP layers (num_nextn_predict_layers "
                f"{'is not read for V2' if self.version == 2 else 'is 0 or unset'}), so there is no MTP module to load"
            )
        n = arch.num_layers
        layers = [self.build_layer(n + k) for k in range(c.num_mtp_layers)] if mtp else []
        self.mtp = nn.ModuleList(MTPLayer(b, arch.vocab_size, c.hidden_size, c.rms_norm_eps, parallel) for b in layers)
        # MTP tensors -> the `mtp` modules; without the module the loader skips them instead
        self.checkpoint_prefixes = checkpoint_prefixes(n, c.num_mtp_layers) if mtp else ()

    def build_attention(self, layer_idx: int) -> nn.Module:
        return MLAAttention(self.config, layer_idx, self.parallel)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        if layer_idx in c.moe_layers:
            return DeepseekMoE(c, self.parallel)
        return GatedMLP(c.hidden_size, c.intermediate_size, False, self.parallel)

    def rotary_embedding(self) -> RotaryEmbedding:
        c = self.config
        return RotaryEmbedding(c.qk_rope_head_dim, self.arch.max_position_embeddings, c.rope_theta, c.rope_scaling)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """V3/R1 checkpoints hold their MTP modules as layers num_hidden_layers..; a model built
        without `mtp` skips their tensors (one with it loads them through checkpoint_prefixes)."""
        parts = name.split(".")
        if super().skips_checkpoint_tensor(name):  # another pipeline stage's
            return True
        n = self.arch.num_layers
        return (
            not len(self.mtp)
            and len(parts) > 2
            and parts[:2] == ["model", "layers"]
            and parts[2].isdigit()
            and n <= int(parts[2]) < n + self.config.num_mtp_layers
        )

    def adapt_to_checkpoint(self, names: set[str] | None) -> None:
        """Before materialising (the loader calls it with the checkpoint's tensor names): MTP
        layers without their own embedding or head share the main model's."""
        if len(self.mtp):
            share_absent_tables(self, names)
            keep_dense_eh_proj(self, names)

    def mtp_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, depth: int = 0
    ) -> torch.Tensor:
        """MTP layer `depth` at rows (position t, token t+1, h_t): `hidden` is this model's forward
        output at those rows (after the final norm), or the previous depth's result. -> [T, H],
        the input of mtp_compute_logits and of depth + 1 (models/deepseek_mtp.py)."""
        return self.mtp[depth](input_ids, positions, hidden, self.model.rotary_emb)

    def mtp_compute_logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return self.mtp[depth].compute_logits(hidden)

    def kv_cache_specs(self) -> list[MLAAttentionSpec | None]:
        """Every layer caches the latent and the rope key: kv_lora_rank + qk_rope_head_dim a token;
        MTP layers (when built) after the main ones, at their attention's layer index. A pipeline
        stage: None for the other stages' layers."""
        c = self.config
        specs = [MLAAttentionSpec(c.kv_lora_rank, c.qk_rope_head_dim)] * (self.arch.num_layers + len(self.mtp))
        return specs if self.parallel.stages == 1 else stage_kv_specs(specs, self.model.layer_range)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    version = 3
    has_mtp = True  # build_model(..., mtp=True) may ask for its MTP layers
