"""Linear methods: how a linear layer stores its weights and runs its GEMM: unquantized.py (F.linear)
and fp8.py (FP8 per-tensor, per-channel, block, online), chosen from spec.py's reading of a
checkpoint's quantization_config (docs/quantization.md). MXFP4 plugs in the same way, later."""
