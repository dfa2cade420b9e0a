"""gpt-fast's Mixtral-8x7B (its `mixtral-moe` example) decoding at batch 1 on random bf16 weights:
the peer `benchmarks/decode_bs1_moe.py` runs next to atomc.

It imports gpt-fast's own `model.py` and `generate.py` from `.peers/gpt-fast/` (put there by
`benchmarks/peers/fetch_gpt_fast.sh`) and runs them as its `generate.py --compile` does: Inductor
settings from importing generate.py (coordinate-descent tuning), `decode_one_token` compiled with
mode="reduce-overhead" and fullgraph=True (CUDA graphs), the prefill eager, sampling at its
defaults (temperature 0.8, top-k 200), one untimed compile run and then `--num-samples` timed runs,
each timed around `generate()` from the prompt to the last token with a device sync either side
(prefill included: gpt-fast's own tokens/sec). What differs from its main(): the weights are random
instead of a converted checkpoint (built on the meta device in bf16 and then materialised on the
GPU, so the 93 GB are never held twice), and the prompt is `--prompt-len` random ids instead of a
tokenized string. Its eager prefill gathers every prompt token's expert weights ([T, 2, 14336,
4096] per projection and layer), so the prompt stays short (8 tokens).

    python benchmarks/peers/gpt_fast_mixtral.py                # prints "RESULT {json}"
    python benchmarks/peers/gpt_fast_mixtral.py --tiny         # 2 small layers on the CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from checkpoints import CONFIGS, tiny_config  # noqa: E402
from peers.gpt_fast_run import (  # noqa: E402
    build_random,
    compile_decode_step,
    gpt_fast_commit,
    import_path,
    rate_fields,
    report,
    timed_generations,
)


def import_gpt_fast(folder: Path):
    """gpt-fast's generate and model modules, imported from `folder`."""
    import_path(folder, ("generate.py", "model.py"))
    import generate
    import model

    return generate, model


def model_args(gmodel, tiny: bool):
    """gpt-fast's own Mixtral-8x7B entry, checked against the published config; or a tiny one."""
    if tiny:
        c = tiny_config("mixtral-8x7b")
        return gmodel.ModelArgs(
            block_size=256, n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"],
            n_local_heads=c["num_key_value_heads"], dim=c["hidden_size"], intermediate_size=c["intermediate_size"],
            vocab_size=c["vocab_size"], rope_base=c["rope_theta"], num_experts=c["num_local_experts"],
            num_activated_experts=c["num_experts_per_tok"],
        )  # fmt: skip
    args = gmodel.ModelArgs.from_name("Mixtral-8x7B-v0.1")
    c = CONFIGS["mixtral-8x7b"]
    got = (args.n_layer, args.dim, args.n_head, args.n_local_heads, args.intermediate_size, args.vocab_size,
           args.num_experts, args.num_activated_experts)  # fmt: skip
    want = (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c["intermediate_size"], c["vocab_size"], c["num_local_experts"], c["num_experts_per_tok"])  # fmt: skip
    if got != want:
        raise SystemExit(f"gpt-fast's Mixtral-8x7B-v0.1 entry {got} is not the published config {want}")
    return args


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt-fast-dir", default=str(ROOT / ".peers" / "gpt-fast"))
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--num-samples", type=int, default=5, help="timed runs after the compile run (gpt-fast's default)")
    ap.add_argument("--tiny", action="store_true", help="2 small layers on the CPU: checks the code path")
    ap.add_argument("--device", default=None, help="default: cuda, cpu with --tiny")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = args.device or ("cpu" if args.tiny else "cuda")
    gen, gmodel = import_gpt_fast(Path(args.gpt_fast_dir))

    t0 = time.perf_counter()
    margs = model_args(gmodel, args.tiny)
    model = build_random(gmodel, margs, device, torch.bfloat16)
    gen.device_sync(device=device)
    build_s = time.perf_counter() - t0

    # what generate.py's main() does with --compile
    torch._inductor.config.assert_indirect_indexing = False
    compile_decode_step(gen)
    torch.manual_seed(1234)
    prompt = torch.randint(3, margs.vocab_size, (args.prompt_len,), dtype=torch.int, device=device)

    def generate() -> int:
        y = gen.generate(model, prompt, args.max_new_tokens, interactive=False, temperature=0.8, top_k=200)
        return y.size(0) - args.prompt_len

    compile_s, runs = timed_generations(gen, device, args.num_samples, generate)
    res = {
        "engine": "gpt-fast mixtral-moe (compiled, reduce-overhead)",
        "gpt_fast_commit": gpt_fast_commit(Path(args.gpt_fast_dir)),
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        **rate_fields(runs),
        "startup_s": build_s + compile_s,
        "build_s": build_s,
        "compile_run_s": compile_s,
        "max_memory_reserved_GB": torch.cuda.max_memory_reserved() / 1e9 if device.startswith("cuda") else None,
        "runs": runs,
    }
    report(res, args.out)


if __name__ == "__main__":
    main()
