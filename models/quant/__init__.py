"""Linear methods: how a linear layer stores its weights and runs its GEMM (unquantized today; FP8 and
MXFP4 plug in as further methods without touching the layers or the loader)."""
