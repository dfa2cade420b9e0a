"""Linear methods: how a linear layer stores its weights and runs its GEMM: unquantized.py (F.linear)
and fp8.py (FP8 per-tensor, per-channel, block, online; block dequantised at load), chosen from spec.py's reading of a
checkpoint's quantization_config (docs/quantization.md); mxfp4.py and fp8_moe.py are the
MoE-experts counterparts (MoE methods on FusedMoE: GPT-OSS's MXFP4 experts, weight-only FP8 experts)."""
