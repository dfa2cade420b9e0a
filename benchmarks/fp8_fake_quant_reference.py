"""An independent reference for benchmarks/fp8_accuracy.py's log-likelihood figures: the same texts
through transformers, unquantised and with every decoder linear fake-quantised as atomc's online FP8
computes it (per-output-row weight scales, dynamic per-token activation scales, amax / 448, an e4m3
round trip), so the per-token log-probability differences of the two atomc servers can be told apart
from the format's own.

    python benchmarks/fp8_fake_quant_reference.py --model DIR [--docs 50] [--dtype float32] [--schemes ...]

DIR: a Hugging Face model folder (for the default model, the folder atomc converts its GGUF into:
the `model folder` line of `atomc serve`'s start-up log names it). Prints mean / p99 / max of
|fake-quant - unquantised| over every token of the first --docs atomc_arith test documents, per
scheme (--schemes, comma-separated), to tell the weights' share of the error from the activations':
- channel-token: atomc's online FP8 (per-row weights, per-token activations);
- channel-only: the same weights, activations unquantised (weight-only FP8);
- block: 128x128 weight blocks, activations per token-group of 128 (the DeepSeek-V3 / Qwen3 FP8 format).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent.parent / "atomc" / "bench" / "lm_eval_tasks" / "atomc_arith_test.jsonl"


def fake_fp8(x: torch.Tensor, dim: int) -> torch.Tensor:
    s = (x.abs().amax(dim=dim, keepdim=True).float() / 448).clamp(min=1e-12)
    return ((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(x.dtype)


def fake_fp8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per group of `group` values along the last dim (a K not divisible by it: per token)."""
    if x.shape[-1] % group:
        return fake_fp8(x, -1)
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    return fake_fp8(g, -1).reshape(x.shape)


def fake_fp8_blocks(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Per [block, block] tile of a [N, K] weight (padded tiles at the edges)."""
    n, k = w.shape
    pn, pk = -n % block, -k % block
    wp = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    tiles = wp.reshape((n + pn) // block, block, (k + pk) // block, block)
    s = (tiles.abs().amax(dim=(1, 3), keepdim=True) / 448).clamp(min=1e-12)
    q = (tiles / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return q.reshape(n + pn, k + pk)[:n, :k].to(w.dtype)


SCHEMES = {  # name -> (weight fake-quant, activation fake-quant or None)
    "channel-token": (lambda w: fake_fp8(w, 1), lambda x: fake_fp8(x, -1)),
    "channel-only": (lambda w: fake_fp8(w, 1), None),
    "block": (fake_fp8_blocks, lambda x: fake_fp8_groups(x, 128)),
}


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0]


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--docs", type=int, default=50)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--schemes", default="channel-token", help=",".join(SCHEMES))
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[: args.docs]]
    ids = [torch.tensor(tok(f"Question: {r['question']}\nAnswer: {r['answer']}")["input_ids"]) for r in rows]
    base = None
    for name in args.schemes.split(","):
        quant_w, quant_x = SCHEMES[name]
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
        if base is None:
            base = [token_logprobs(model, t) for t in ids]
        for mod in model.model.modules():  # the decoder's linears; the LM head stays as it is (as in atomc)
            if isinstance(mod, torch.nn.Linear):
                mod.weight.data = quant_w(mod.weight.data)
                if quant_x is not None:
                    mod.register_forward_pre_hook(lambda _m, a, q=quant_x: (q(a[0]),))
        quant = [token_logprobs(model, t) for t in ids]
        diff = torch.cat([(a - b).abs() for a, b in zip(base, quant, strict=True)]).sort().values
        p99 = diff[int(0.99 * (diff.numel() - 1))]
        print(f"{name}: tokens {diff.numel()} mean {diff.mean():.6f} p99 {p99:.6f} max {diff[-1]:.6f}")


if __name__ == "__main__":
    main()
