"""Physical ceilings the benchmarks report against, with the GPU's rates measured in the same call.

Measured (in a child process, so the benchmark's own process holds no CUDA context):
- bandwidth: a 1 GiB device-to-device copy, bytes read + written over the time;
- matmul rate: a bf16 cuBLAS GEMM at a prefill shape (8,192 tokens through the 8B's gate_up).

Ceilings:
- batch-1 decode: tok/s = bandwidth / weight bytes streamed per token.
- serving at ISL/OSL and concurrency C (the one `docs/performance.md` and the targets use): every
  request's prefill runs at the measured matmul rate, not overlapped with decode, and each of the
  OSL decode steps streams the weights once plus every sequence's KV at mid-sequence:
      tok/s = C * OSL / (OSL * (W + C * KV(ISL + OSL / 2)) / bandwidth + C * prefill_flops / rate)
  Prefill FLOPs per request: 2 x matmul parameters x ISL (logits for the last token only, as
  engines compute them) plus causal attention, 2 x ISL^2 x heads x head_dim per layer.
- decode-only bound: the same without the prefill term. No engine reaches it at this load, since
  the prefill must run somewhere; it is reported to show how much of a step the decode costs.

Mixtures of experts (`moe_*`, for Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek; a model is a name in
`checkpoints.CONFIGS` or a config dict) read only some experts a step, so W above becomes:
- batch-1 decode (the active-weight roofline): the non-expert weights (attention, router, norms,
  embeddings row, lm_head; dense MLP layers where the config has them) + top_k experts per sparse
  layer + the KV of the sequence at mid-output (ISL + OSL/2; a sliding-window layer holds at most
  its window).
- CONC c decode step: the non-expert weights + D(c) experts per sparse layer + c sequences' KV,
  with D(c) the expected number of distinct experts a step reads in a layer:
      D(c) = E * (1 - (1 - k/E)^c)
  Derivation: a token's router picks k distinct experts of E; with uniform routing a given expert
  is among them with probability k/E, independently for the c tokens of the step, so it is read
  by none of them with probability (1 - k/E)^c; summing "read by at least one" over the E experts
  (linearity of expectation) gives D(c). D(1) = k; D(c) -> E as c grows (Qwen3-30B-A3B, E = 128,
  k = 8: D(8) = 51.6, D(64) = 125.9). Uniform routing is the worst case: D is a sum of concave
  terms 1 - (1 - p_e)^c with sum(p_e) = k, largest when every p_e = k/E, so skewed routing reads
  fewer experts and an engine could beat this ceiling on it; random weights route near-uniformly.
- prefill FLOPs per token: 2 x the matmul parameters a token goes through (attention, router, its
  k experts) plus attention over its causal keys (at most the window on sliding layers), at the
  measured dense matmul rate (a grouped expert GEMM is smaller, so this stays an upper bound).
The serving ceiling and the decode-only bound are then formed as for dense models.
FP8 MoE (`weights="fp8"`, atomc's `--quantization fp8`): every linear and expert projection one
byte a value plus an fp32 scale a row (per-channel); the router, norms, biases, lm_head and the
KV cache stay bf16 (atomc quantises neither routers nor the head). MXFP4 MoE (`weights="mxfp4"`,
GPT-OSS as published): the experts' three projections at half a byte a value plus a scale byte per
32 values; everything else (attention, router, biases, embeddings, lm_head, KV) bf16.

DeepSeek-V2/V3 (multi-head latent attention, `MlaDims`): the attention weights are q (q_a_proj, its
norm and q_b_proj when q_lora_rank is set; else q_proj), kv_a_proj_with_mqa, the latent's norm,
kv_b_proj (every head's W_UK and W_UV) and o_proj; the non-expert weights also hold the shared
experts of each sparse layer (n_shared_experts x 3 x hidden x moe_intermediate_size, read by every
token) and the dense MLPs of the first first_k_dense_replace layers. The cache holds, per token and
layer, the latent and the rope key, kv_lora_rank + qk_rope_head_dim values shared by every head
(576 for V2-Lite and V3: 1,152 B in bf16, against 2 x 16 heads x 192 for V2-Lite's expanded K/V), and
that is what a decode step reads. Prefill attention is counted in the expanded form, 2 x heads x
(qk_nope + qk_rope + v_head) FLOPs a key, the least any engine must do (the absorbed form atomc
runs does 2 x (kv_lora + rope + kv_lora) a head and key instead; W_UK and W_UV cost the same in
both, a per-token matmul counted with the weights). The router's weight and V3's
e_score_correction_bias are counted at the weights' dtype (transformers keeps them in fp32: 3.7 MB a
V3 layer more).

MLA decode attention alone (`mla_decode_roofline`, for benchmarks/mla_decode.py): in the absorbed
form every head's key is the token's whole latent row (kv_lora + rope values) and its value the
c_kv part, and all heads read the same row. Per (head, key) the kernel does QK over kv_lora + rope
and PV over kv_lora, 2 x (576 + 512) = 2,176 FLOPs at V3's widths, while the row is read once for
all heads, 576 x 2 bytes in bf16. So
    intensity = heads x 2 x (kv_lora + rope + kv_lora) / ((kv_lora + rope) x 2) = 1.89 x heads FLOP/B
(242 at 128 heads) at any batch and context (queries and outputs, heads x (576 + 512) x 2 bytes a
sequence, are left out: 6% at 4k context). The bound is min time = max(bytes / bandwidth,
FLOPs / peak); with an H200's dense bf16 peak of 989 TFLOP/s against 4.3 TB/s (ridge 230 FLOP/B),
V3's decode is compute-bound (by 5%), and 70% of HBM bandwidth means 0.7 x 4.3 TB/s x 242 FLOP/B
= 730 TFLOP/s, 74% of the peak.

    python benchmarks/ceilings.py     # prints the measured rates as JSON
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import CONFIGS, weight_bytes  # noqa: E402

# a model is a name in checkpoints.CONFIGS or a config dict (a tiny one, an edited one)


def _measure() -> dict:
    import torch

    def timed(fn, iters: int) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters

    def bandwidth() -> float:
        src = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # 1 GiB, far past L2
        dst = torch.empty_like(src)
        return 2 * src.numel() / timed(lambda: dst.copy_(src), 20)

    def matmul_rate() -> float:
        a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2 * 14336, 4096, device="cuda", dtype=torch.bfloat16)
        return 2 * a.shape[0] * w.shape[0] * w.shape[1] / timed(lambda: torch.nn.functional.linear(a, w), 20)

    return {"bandwidth": bandwidth(), "matmul_flops": matmul_rate(), "device": torch.cuda.get_device_name()}


def measure() -> dict:
    """{"bandwidth": bytes/s, "matmul_flops": FLOP/s, "device": name}, measured in a child process."""
    out = subprocess.run([sys.executable, __file__], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# the copy rate `bandwidth()` measured on each GPU atomc has run on (GB/s), for the kernel
# benchmarks' "% of HBM" when they do not measure it themselves: H200 2026-12-01, H100 SXM
# 2026-12-06 (decode_bs1.py's call, `bs1.json` in benchmarks/results/2026-12-06/)
COPY_GBPS = {"H200": 4300.0, "H100": 3030.0}


def copy_gbps(device_name: str, default: float = 4300.0) -> float:
    """COPY_GBPS for a GPU named `device_name` (torch.cuda.get_device_name()), else `default`."""
    return next((gbps for key, gbps in COPY_GBPS.items() if key in device_name), default)


def local_copy_gbps() -> float:
    """copy_gbps of this process's GPU (the H200's without one)."""
    import torch

    return copy_gbps(torch.cuda.get_device_name() if torch.cuda.is_available() else "")


# dense bf16 tensor-core peaks (datasheets, FLOP/s), matched against torch.cuda.get_device_name()
DENSE_BF16_PEAK = {"H200": 989.4e12, "H100": 989.4e12, "H800": 989.4e12, "H20": 148e12, "A100": 312e12}


def dense_bf16_peak(device_name: str) -> float | None:
    """The datasheet's dense bf16 rate of a GPU named `device_name`, None if not in the table."""
    return next((flops for key, flops in DENSE_BF16_PEAK.items() if key in device_name), None)


def mla_decode_roofline(
    bs: int, ctx: int, heads: int, kv_lora: int, rope: int, bandwidth: float, peak_flops: float, dtype_bytes: int = 2
) -> dict:
    """The roofline of one MLA decode call (absorbed form, one query a sequence, every sequence at
    context `ctx`): the latent bytes it must read, the FLOPs its dots do, and the bound
    max(bytes / bandwidth, FLOPs / peak_flops) in seconds (see the module docstring)."""
    latent_bytes = bs * ctx * (kv_lora + rope) * dtype_bytes
    flops = 2 * bs * heads * ctx * ((kv_lora + rope) + kv_lora)  # QK over kv_lora + rope, PV over kv_lora
    memory_s, compute_s = latent_bytes / bandwidth, flops / peak_flops
    return {
        "latent_bytes": latent_bytes,
        "flops": flops,
        "intensity": flops / latent_bytes,
        "ridge": peak_flops / bandwidth,
        "memory_s": memory_s,
        "compute_s": compute_s,
        "bound_s": max(memory_s, compute_s),
        "bound": "compute" if compute_s > memory_s else "memory",
    }


def _config(model: str | dict) -> dict:
    return CONFIGS[model] if isinstance(model, str) else model


def kv_bytes_per_token(name: str | dict, dtype_bytes: int = 2) -> int:
    c = _config(name)
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * dtype_bytes


def prefill_flops(name: str | dict, isl: int) -> float:
    c = _config(name)
    h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d, hq, hkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    matmul_params = n * (h * d * (hq + 2 * hkv) + hq * d * h + 3 * h * i)
    return 2 * matmul_params * isl + 2 * isl**2 * hq * d * n


WEIGHT_FORMATS = ("bf16", "fp8", "mxfp4")
MXFP4_BYTES_PER_VALUE = 0.5 + 1 / 32  # an e2m1 nibble, and an e8m0 scale byte per 32 values
FP8_ROW_SCALE_BYTES = 4  # atomc's per-channel scales are fp32
FP8_MATMUL_SPEEDUP = 2.0  # Hopper's dense FP8 tensor-core peak against bf16's (1,979 / 989 TFLOP/s)


def dense_weight_bytes(name: str | dict, weights: str = "bf16") -> int:
    """A dense decode step's weight bytes; "fp8": atomc's `--quantization fp8` (every decoder linear
    a byte a value plus an fp32 scale a row; lm_head, embeddings and norms bf16)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weights!r} is not one of: {', '.join(WEIGHT_FORMATS)}")
    if weights == "bf16":
        return weight_bytes(name)
    if weights != "fp8":
        raise ValueError(f"weights {weights!r}: a dense model has no experts to hold in it")
    return weight_bytes(name, linear_bytes=1, row_scale_bytes=FP8_ROW_SCALE_BYTES)


def decode_step_s(
    name: str | dict, conc: int, isl: int, osl: int, bandwidth: float, weights: str = "bf16", kv_dtype_bytes: int = 2
) -> float:
    kv = conc * kv_bytes_per_token(name, kv_dtype_bytes) * (isl + osl // 2)
    return (dense_weight_bytes(name, weights) + kv) / bandwidth


def ceiling_tok_s(conc: int, osl: int, step_s: float, prompt_flops: float, matmul_flops: float, weights: str) -> float:
    """conc x osl tokens over osl decode steps plus conc prompts' prefill; an FP8 prefill's GEMMs at
    the FP8 rate, counted as the whole prefill's (a stricter ceiling)."""
    rate = matmul_flops * (FP8_MATMUL_SPEEDUP if weights == "fp8" else 1.0)
    return conc * osl / (osl * step_s + conc * prompt_flops / rate)


def serving_ceiling(
    name: str | dict, conc: int, isl: int, osl: int, bandwidth: float, matmul_flops: float,
    weights: str = "bf16", kv_dtype_bytes: int = 2,
) -> float:  # fmt: skip
    step_s = decode_step_s(name, conc, isl, osl, bandwidth, weights, kv_dtype_bytes)
    return ceiling_tok_s(conc, osl, step_s, prefill_flops(name, isl), matmul_flops, weights)


def decode_only_bound(
    name: str | dict, conc: int, isl: int, osl: int, bandwidth: float, weights: str = "bf16", kv_dtype_bytes: int = 2
) -> float:
    return conc / decode_step_s(name, conc, isl, osl, bandwidth, weights, kv_dtype_bytes)


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention's widths (DeepSeek-V2/V3): q through a LoRA of `q_lora` (0: one
    q_proj), the latent of `kv_lora` values and the `rope` key dims a token caches, per head a
    no-rope q/k part of `nope` and a value of `v`."""

    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int


@dataclass(frozen=True)
class MoeShape:
    """The sizes of a decoder whose MLP is (in some layers) a mixture of experts, from config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int  # E, per sparse layer
    top_k: int  # k
    expert_inter: int  # intermediate size of one expert
    sparse_layers: int  # layers whose MLP is the expert block; the rest run a dense MLP
    dense_inter: int
    attn_bias: bool  # q/k/v/o biases and per-head sinks (GPT-OSS)
    expert_bias: bool  # router and expert biases (GPT-OSS)
    qk_norm: bool  # per-head q/k RMSNorm weights (Qwen3)
    sliding_layers: int
    window: int  # 0: no sliding-window layer
    mla: MlaDims | None = None  # DeepSeek: latent attention instead of q/k/v/o heads
    shared_inter: int = 0  # intermediate size of the shared experts, all of them as one MLP (DeepSeek)
    router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (one value an expert)

    @property
    def dense_layers(self) -> int:
        return self.layers - self.sparse_layers

    def attn_params(self) -> int:
        if self.mla is not None:
            return self._mla_params()
        h, d, hq, hkv = self.hidden, self.head_dim, self.heads, self.kv_heads
        p = h * d * (hq + 2 * hkv) + hq * d * h
        if self.attn_bias:
            p += d * (hq + 2 * hkv) + h + hq
        return p + (2 * d if self.qk_norm else 0)

    def _mla_params(self) -> int:
        """q (q_a_proj, its norm, q_b_proj; or q_proj), kv_a_proj_with_mqa, the latent's norm,
        kv_b_proj (W_UK and W_UV of every head) and o_proj, with their biases where the config has them."""
        m, h, heads = self.mla, self.hidden, self.heads
        qk = m.nope + m.rope
        q = h * m.q_lora + m.q_lora + m.q_lora * heads * qk if m.q_lora else h * heads * qk
        kv = h * (m.kv_lora + m.rope) + m.kv_lora + m.kv_lora * heads * (m.nope + m.v)
        o = heads * m.v * h
        bias = (m.q_lora + m.kv_lora + m.rope + h) if self.attn_bias else 0  # q_a, kv_a, o
        return q + kv + o + bias

    def qk_head_dim(self) -> int:
        return self.mla.nope + self.mla.rope if self.mla else self.head_dim

    def v_head_dim(self) -> int:
        return self.mla.v if self.mla else self.head_dim

    def kv_values_per_token_layer(self) -> int:
        """Cached values a token holds in one layer: MLA's latent and rope key, shared by every head
        (kv_lora + rope), or a K and a V per KV head."""
        return self.mla.kv_lora + self.mla.rope if self.mla else 2 * self.kv_heads * self.head_dim

    def shared_params(self) -> int:
        """The shared experts of one sparse layer (every token goes through them)."""
        return 3 * self.hidden * self.shared_inter

    def attn_linear(self) -> tuple[int, int]:
        """(weights, output rows) of one layer's q/k/v and o projections (what FP8 quantises)."""
        h, d, hq, hkv = self.hidden, self.head_dim, self.heads, self.kv_heads
        return h * d * (hq + 2 * hkv) + hq * d * h, d * (hq + 2 * hkv) + h

    def expert_params(self) -> int:
        """One expert: gate, up and down projections (and their biases)."""
        h, i = self.hidden, self.expert_inter
        return 3 * h * i + (2 * i + h if self.expert_bias else 0)

    def router_params(self) -> int:
        return self.experts * self.hidden + (self.experts if self.expert_bias or self.router_bias else 0)

    def nonexpert_params(self) -> int:
        """What every step reads whatever the routing: attention, norms, routers, shared experts,
        dense MLPs, the final norm and lm_head (the embedding table is read one row a token: left out)."""
        per_layer = self.attn_params() + 2 * self.hidden
        return (
            self.layers * per_layer
            + self.sparse_layers * (self.router_params() + self.shared_params())
            + self.dense_layers * 3 * self.hidden * self.dense_inter
            + self.vocab * self.hidden
            + self.hidden
        )


def _deepseek_shape(c: dict) -> MoeShape:
    """DeepSeek-V2/V3: layers from first_k_dense_replace on are sparse (moe_layer_freq 1, as atomc
    and transformers read it), each with n_shared_experts shared experts of moe_intermediate_size."""
    if c.get("moe_layer_freq", 1) != 1:
        freq = c["moe_layer_freq"]
        raise ValueError(f"moe_layer_freq={freq} is not modelled (every layer from first_k_dense_replace on is sparse)")
    n, heads, inter = c["num_hidden_layers"], c["num_attention_heads"], c["moe_intermediate_size"]
    mla = MlaDims(
        q_lora=c.get("q_lora_rank") or 0, kv_lora=c["kv_lora_rank"], nope=c["qk_nope_head_dim"],
        rope=c["qk_rope_head_dim"], v=c["v_head_dim"],
    )  # fmt: skip
    return MoeShape(
        hidden=c["hidden_size"], layers=n, heads=heads, kv_heads=heads, head_dim=mla.nope + mla.rope,
        vocab=c["vocab_size"], experts=c["n_routed_experts"], top_k=c["num_experts_per_tok"], expert_inter=inter,
        sparse_layers=n - min(c.get("first_k_dense_replace") or 0, n), dense_inter=c["intermediate_size"],
        attn_bias=bool(c.get("attention_bias")), expert_bias=False, qk_norm=False, sliding_layers=0, window=0,
        mla=mla, shared_inter=inter * (c.get("n_shared_experts") or 0),
        router_bias=c.get("model_type") == "deepseek_v3",
    )  # fmt: skip


def moe_shape(model: str | dict) -> MoeShape:
    c = _config(model)
    if c.get("n_routed_experts"):
        return _deepseek_shape(c)
    h, n, hq = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    experts = c.get("num_local_experts") or c.get("num_experts") or 0
    if not experts:
        raise ValueError(
            f"{c.get('architectures')} is not a mixture of experts (no num_local_experts/num_experts/n_routed_experts)"
        )
    top_k = c.get("num_experts_per_tok") or c["experts_per_token"]
    if "moe_intermediate_size" in c:  # Qwen3-MoE: experts and dense MLP layers have their own sizes
        step, only = c.get("decoder_sparse_step", 1) or 1, set(c.get("mlp_only_layers") or [])
        sparse = sum(1 for i in range(n) if i not in only and (i + 1) % step == 0)
        expert_inter, dense_inter = c["moe_intermediate_size"], c["intermediate_size"]
    else:  # Mixtral, GPT-OSS: every layer sparse, intermediate_size is an expert's
        sparse, expert_inter, dense_inter = n, c["intermediate_size"], 0
    types = c.get("layer_types") or []
    sliding = sum(1 for t in types if t == "sliding_attention")
    if not types and c.get("sliding_window") and c.get("use_sliding_window", True):
        sliding = n  # a window on every layer (Mixtral's config has none: null)
    gpt_oss = c.get("model_type") == "gpt_oss"
    return MoeShape(
        hidden=h, layers=n, heads=hq, kv_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or h // hq, vocab=c["vocab_size"], experts=experts, top_k=top_k,
        expert_inter=expert_inter, sparse_layers=sparse, dense_inter=dense_inter,
        attn_bias=bool(c.get("attention_bias")), expert_bias=gpt_oss, qk_norm=c.get("model_type") == "qwen3_moe",
        sliding_layers=sliding, window=(c.get("sliding_window") or 0) if sliding else 0,
    )  # fmt: skip


def expected_distinct_experts(experts: int, top_k: int, conc: int) -> float:
    """D(c) = E (1 - (1 - k/E)^c): distinct experts a layer reads for c tokens routed uniformly."""
    return experts * (1 - (1 - top_k / experts) ** conc)


def moe_kv_bytes(model: str | dict, context: int, dtype_bytes: int = 2) -> int:
    """KV bytes one sequence of `context` tokens has in the cache (all read by a decode step)."""
    s = moe_shape(model)
    per_layer_token = s.kv_values_per_token_layer() * dtype_bytes
    full = s.layers - s.sliding_layers
    return per_layer_token * (full * context + s.sliding_layers * min(context, s.window))


def moe_step_bytes(
    model: str | dict, conc: int, context: int, dtype_bytes: int = 2, weights: str = "bf16",
    kv_dtype_bytes: int | None = None,
) -> float:  # fmt: skip
    """Bytes a decode step of `conc` sequences at `context` tokens reads: the non-expert weights,
    D(conc) experts in each sparse layer, every sequence's KV (at `kv_dtype_bytes` a value, default
    `dtype_bytes`). `weights` "fp8": the linears and experts at one byte a value plus a scale a row
    (module docstring)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weights!r} is not one of: {', '.join(WEIGHT_FORMATS)}")
    s = moe_shape(model)
    experts = s.sparse_layers * expected_distinct_experts(s.experts, s.top_k, conc)
    kv = conc * moe_kv_bytes(model, context, dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes)
    if weights == "bf16":
        return dtype_bytes * (s.nonexpert_params() + experts * s.expert_params()) + kv
    if weights == "mxfp4":  # GPT-OSS as published: the experts' projections only (biases bf16)
        matrices = 3 * s.hidden * s.expert_inter
        expert = matrices * MXFP4_BYTES_PER_VALUE + dtype_bytes * (s.expert_params() - matrices)
        return dtype_bytes * s.nonexpert_params() + experts * expert + kv
    if s.mla:
        raise ValueError("FP8 bytes of latent-attention models are not counted (atomc refuses DeepSeek FP8)")
    attn, attn_rows = s.attn_linear()
    dense_mlp, dense_rows = 3 * s.hidden * s.dense_inter, 2 * s.dense_inter + s.hidden
    fp8 = s.layers * attn + s.dense_layers * dense_mlp  # non-expert linears in FP8
    rows = s.layers * attn_rows + s.dense_layers * dense_rows
    h, i = s.hidden, s.expert_inter
    expert = 3 * h * i + FP8_ROW_SCALE_BYTES * (2 * i + h) + dtype_bytes * (s.expert_params() - 3 * h * i)
    return dtype_bytes * (s.nonexpert_params() - fp8) + fp8 + FP8_ROW_SCALE_BYTES * rows + experts * expert + kv


def moe_layer_bytes(model: str | dict, conc: int, context: int, dtype_bytes: int = 2, weights: str = "bf16") -> dict:
    """What a decode step of `conc` sequences at `context` tokens reads, by part: one dense layer
    (attention, its norms, the dense MLP, its share of every sequence's KV), one sparse layer
    (attention, norms, router, shared experts, D(conc) experts, KV) and the rest (the final norm and
    lm_head). `layers` dense x dense + sparse x sparse + rest is `moe_step_bytes` (full-attention
    models: a sliding window makes layers differ). `weights` "fp8_block": DeepSeek's published
    block FP8 as atomc loads it (`mla_fp8_block_layer_bytes`)."""
    s = moe_shape(model)
    kv = conc * context * s.kv_values_per_token_layer() * dtype_bytes
    distinct = expected_distinct_experts(s.experts, s.top_k, conc)
    rest = dtype_bytes * (s.vocab * s.hidden + s.hidden)
    if weights == "fp8_block":
        dense, sparse = mla_fp8_block_layer_bytes(s, distinct, dtype_bytes)
        return {"dense": dense + kv, "sparse": sparse + kv, "rest": rest}
    if weights != "bf16":
        raise ValueError(f"layer bytes are counted for bf16 and fp8_block weights, not {weights!r}")
    common = s.attn_params() + 2 * s.hidden
    experts = distinct * s.expert_params()
    return {
        "dense": dtype_bytes * (common + 3 * s.hidden * s.dense_inter) + kv,
        "sparse": dtype_bytes * (common + s.router_params() + s.shared_params() + experts) + kv,
        "rest": rest,
    }


def fp8_block_bytes(n: int, k: int, block: int = 128) -> int:
    """An [n, k] e4m3 weight and its fp32 scale per block x block tile (edge tiles partial)."""
    return n * k + 4 * (-(-n // block)) * (-(-k // block))


def mla_fp8_block_layer_bytes(s: MoeShape, experts: float, dtype_bytes: int = 2) -> tuple[float, float]:
    """(dense layer, sparse layer) weight bytes of DeepSeek's block-FP8 checkpoints as atomc holds
    them (docs/quantization.md): q_a and kv_a as one GEMM, q_b (or q_proj), o, the MLPs, shared and
    routed experts in FP8 blocks; kv_b_proj dequantised into the model dtype at load (the absorbed
    attention reads its per-head views); norms and the router in the model dtype, the router's
    correction bias in fp32. `experts`: the
    distinct routed experts a sparse layer reads."""
    if s.mla is None:
        raise ValueError("fp8_block layer bytes are counted for DeepSeek's latent attention only")
    m, h, heads = s.mla, s.hidden, s.heads
    qk = m.nope + m.rope
    if m.q_lora:
        q = fp8_block_bytes(m.q_lora + m.kv_lora + m.rope, h) + fp8_block_bytes(heads * qk, m.q_lora)
        norms = m.q_lora + m.kv_lora + 2 * h
    else:
        q = fp8_block_bytes(heads * qk + m.kv_lora + m.rope, h)
        norms = m.kv_lora + 2 * h
    attn = q + fp8_block_bytes(h, heads * m.v) + dtype_bytes * (m.kv_lora * heads * (m.nope + m.v) + norms)

    def mlp(inter: int) -> int:
        return fp8_block_bytes(2 * inter, h) + fp8_block_bytes(h, inter)

    dense = attn + mlp(s.dense_inter)
    shared = mlp(s.shared_inter) if s.shared_inter else 0
    router = dtype_bytes * s.experts * h + (4 * s.experts if s.router_bias else 0)  # the correction bias is fp32
    sparse = attn + router + shared + experts * mlp(s.expert_inter)
    return dense, sparse


def moe_active_bytes(model: str | dict, context: int = 0, dtype_bytes: int = 2, weights: str = "bf16") -> float:
    """Batch-1 bytes a token: the non-expert weights, top_k experts per sparse layer, KV at `context`."""
    return moe_step_bytes(model, 1, context, dtype_bytes, weights)


def moe_bs1_roofline(model: str | dict, isl: int, osl: int, bandwidth: float, weights: str = "bf16") -> float:
    """tok/s of batch-1 decode if every byte of a step moves at `bandwidth` (KV at mid-output)."""
    return bandwidth / moe_active_bytes(model, isl + osl // 2, weights=weights)


def moe_prefill_flops(model: str | dict, isl: int) -> float:
    s = moe_shape(model)
    per_token = (
        s.layers * s.attn_params()
        + s.sparse_layers * (s.router_params() + s.shared_params() + s.top_k * s.expert_params())
        + s.dense_layers * 3 * s.hidden * s.dense_inter
    )
    # causal keys summed over the prompt's queries: isl^2 / 2 on a full layer (as the dense formula),
    # isl * w - w^2 / 2 on a layer with a window of w < isl
    w = min(s.window, isl) if s.window else isl
    keys = (s.layers - s.sliding_layers) * isl**2 / 2 + s.sliding_layers * (isl * w - w**2 / 2)
    # per head and key: QK over the q/k head dims, PV over the value dims (MLA: its expanded form,
    # nope + rope and v; the absorbed form atomc runs does 2 x (kv_lora + rope + kv_lora) instead)
    return 2 * per_token * isl + 2 * s.heads * (s.qk_head_dim() + s.v_head_dim()) * keys


def moe_decode_step_s(
    model: str | dict, conc: int, isl: int, osl: int, bandwidth: float, weights: str = "bf16", kv_dtype_bytes: int = 2
) -> float:
    return moe_step_bytes(model, conc, isl + osl // 2, weights=weights, kv_dtype_bytes=kv_dtype_bytes) / bandwidth


def moe_serving_ceiling(
    model: str | dict, conc: int, isl: int, osl: int, bandwidth: float, matmul_flops: float,
    weights: str = "bf16", kv_dtype_bytes: int = 2,
) -> float:  # fmt: skip
    step_s = moe_decode_step_s(model, conc, isl, osl, bandwidth, weights, kv_dtype_bytes)
    return ceiling_tok_s(conc, osl, step_s, moe_prefill_flops(model, isl), matmul_flops, weights)


def moe_decode_only_bound(
    model: str | dict, conc: int, isl: int, osl: int, bandwidth: float, weights: str = "bf16", kv_dtype_bytes: int = 2
) -> float:
    return conc / moe_decode_step_s(model, conc, isl, osl, bandwidth, weights, kv_dtype_bytes)


def is_moe(model: str | dict) -> bool:
    c = _config(model)
    return bool(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts"))


def serving_bounds(
    model: str | dict, conc: int, isl: int, osl: int, bandwidth: float, matmul_flops: float,
    weights: str = "bf16", kv_dtype_bytes: int = 2,
) -> dict:  # fmt: skip
    """The serving ceiling and decode-only bound of a cell, by the dense or the MoE definition, for
    the server's weight format and KV bytes a value; for a mixture of experts also D(conc), the
    distinct experts a layer reads a step."""
    fmt = (weights, kv_dtype_bytes)
    if not is_moe(model):
        return {
            "ceiling_tok_s": serving_ceiling(model, conc, isl, osl, bandwidth, matmul_flops, *fmt),
            "decode_bound_tok_s": decode_only_bound(model, conc, isl, osl, bandwidth, *fmt),
        }
    s = moe_shape(model)
    return {
        "ceiling_tok_s": moe_serving_ceiling(model, conc, isl, osl, bandwidth, matmul_flops, *fmt),
        "decode_bound_tok_s": moe_decode_only_bound(model, conc, isl, osl, bandwidth, *fmt),
        "distinct_experts_per_layer": expected_distinct_experts(s.experts, s.top_k, conc),
        "experts": s.experts,
        "top_k": s.top_k,
        "kv_bytes_per_token": moe_kv_bytes(model, 1),  # every layer's, bf16 (MLA: the latent cache)
    }


if __name__ == "__main__":
    print(json.dumps(_measure()))
