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

    python benchmarks/ceilings.py     # prints the measured rates as JSON
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import CONFIGS, weight_bytes  # noqa: E402


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


def kv_bytes_per_token(name: str, dtype_bytes: int = 2) -> int:
    c = CONFIGS[name]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * dtype_bytes


def prefill_flops(name: str, isl: int) -> float:
    c = CONFIGS[name]
    h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d, hq, hkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    matmul_params = n * (h * d * (hq + 2 * hkv) + hq * d * h + 3 * h * i)
    return 2 * matmul_params * isl + 2 * isl**2 * hq * d * n


def decode_step_s(name: str, conc: int, isl: int, osl: int, bandwidth: float) -> float:
    return (weight_bytes(name) + conc * kv_bytes_per_token(name) * (isl + osl // 2)) / bandwidth


def serving_ceiling(name: str, conc: int, isl: int, osl: int, bandwidth: float, matmul_flops: float) -> float:
    total_s = osl * decode_step_s(name, conc, isl, osl, bandwidth) + conc * prefill_flops(name, isl) / matmul_flops
    return conc * osl / total_s


def decode_only_bound(name: str, conc: int, isl: int, osl: int, bandwidth: float) -> float:
    return conc / decode_step_s(name, conc, isl, osl, bandwidth)


if __name__ == "__main__":
    print(json.dumps(_measure()))
