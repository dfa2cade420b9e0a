"""An independent reference for benchmarks/fp8_accuracy.py's log-likelihood figures: the same texts
through transformers, unquantised and with every decoder linear fake-quantised as atomc's online FP8
computes it (per-output-row weight scales, dynamic per-token activation scales, amax / 448, an e4m3
round trip), so the per-token log-probability differences of the two atomc servers can be told apart
from the format's own.

    python benchmarks/fp8_fake_quant_reference.py --model DIR [--docs 50] [--dtype float32]

DIR: a Hugging Face model folder (for the default model, the folder atomc converts its GGUF into:
the `model folder` line of `atomc serve`'s start-up log names it). Prints mean / p99 / max of
|fake-quant - unquantised| over every token of the first --docs atomc_arith test documents.
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
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[: args.docs]]
    ids = [torch.tensor(tok(f"Question: {r['question']}\nAnswer: {r['answer']}")["input_ids"]) for r in rows]
    base = [token_logprobs(model, t) for t in ids]
    for mod in model.model.modules():  # the decoder's linears; the LM head stays as it is (as in atomc)
        if isinstance(mod, torch.nn.Linear):
            mod.weight.data = fake_fp8(mod.weight.data, 1)
            mod.register_forward_pre_hook(lambda _m, a: (fake_fp8(a[0], -1),))
    quant = [token_logprobs(model, t) for t in ids]
    diff = torch.cat([(a - b).abs() for a, b in zip(base, quant, strict=True)]).sort().values
    p99 = diff[int(0.99 * (diff.numel() - 1))]
    print(f"tokens {diff.numel()} mean {diff.mean():.6f} p99 {p99:.6f} max {diff[-1]:.6f}")


if __name__ == "__main__":
    main()
