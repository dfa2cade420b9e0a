"""The building blocks every family shares: TP- and quant-aware linears, vocab-parallel embedding and
LM head, RMSNorm, RoPE, the gated MLP and the Llama-style attention block."""
