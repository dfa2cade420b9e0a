"""Linear methods: how a linear layer stores its weights and runs its GEMM: unquantized.py (F.linear)
and fp8.py (FP8 per-tensor, per-channel, block, online), chosen from spec.py's reading of a
checkpoint's quantization_config (docs/quantization.md); mxfp4.py is the MoE-experts counterpart
(an MoE method on FusedMoE: GPT-OSS's MXFP4 experts)."""
