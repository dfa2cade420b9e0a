"""gpt-fast's Llama-3.1-8B decoding at batch 1 on random weights, bf16 or with its int8 weight-only
quantisation: the peer `benchmarks/decode_bs1.py` runs next to atomc's FP8 (engine `gpt-fast-int8`).

It imports gpt-fast's own `model.py`, `generate.py` and `quantize.py` from `.peers/gpt-fast/llama/`
(put there by `benchmarks/peers/fetch_gpt_fast.sh`) and runs them as `generate.py --compile` does
with a checkpoint that `quantize.py --mode int8` wrote: Inductor settings from importing
generate.py (coordinate-descent tuning), `decode_one_token` compiled with mode="reduce-overhead" and
fullgraph=True (CUDA graphs), the prefill eager, sampling at its defaults (temperature 0.8, top-k
200), one untimed compile run and then `--num-samples` timed runs, each timed around `generate()`
from the prompt to the last token with a device sync either side (prefill included: gpt-fast's own
tokens/sec). The int8 model is made the way quantize.py makes it, on the GPU instead of the CPU:
`WeightOnlyInt8QuantHandler(model).create_quantized_state_dict()` of a random bf16 model (every
nn.Linear, the LM head too, per-channel int8 with bf16 scales), then `convert_for_runtime()` and
`load_state_dict(..., assign=True)`, as its `_load_model` does. What differs from its main(): the
weights are random (norm weights 1) instead of a converted checkpoint, and the prompt is
`--prompt-len` random ids instead of a tokenized string (its tokenizer's packages are stubbed when
missing; random ids need neither).

    python benchmarks/peers/gpt_fast_llama.py --quantize int8   # prints "RESULT {json}"
    python benchmarks/peers/gpt_fast_llama.py --tiny            # 2 small layers on the CPU
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

GPT_FAST_NAME = "llama-3.1-8b"  # gpt-fast's transformer_configs entry


def import_gpt_fast(folder: Path):
    """gpt-fast's generate, model and quantize modules, imported from `folder`."""
    import_path(folder, ("generate.py", "model.py", "quantize.py"))
    import generate
    import model
    import quantize

    return generate, model, quantize


def model_args(gmodel, tiny: bool):
    """gpt-fast's own Llama-3.1-8B entry, checked against the published config; or a tiny one."""
    if tiny:
        c = tiny_config("llama-3.1-8b")
        return gmodel.ModelArgs(
            block_size=256, n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"],
            n_local_heads=c["num_key_value_heads"], dim=c["hidden_size"], intermediate_size=c["intermediate_size"],
            vocab_size=c["vocab_size"], rope_base=c["rope_theta"],
        )  # fmt: skip
    args = gmodel.ModelArgs.from_name(GPT_FAST_NAME)
    c = CONFIGS["llama-3.1-8b"]
    got = (args.n_layer, args.dim, args.n_head, args.n_local_heads, args.intermediate_size, args.vocab_size,
           args.rope_base, args.dim // args.n_head)  # fmt: skip
    want = (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c["intermediate_size"], c["vocab_size"], c["rope_theta"], c["head_dim"])  # fmt: skip
    if got != want:
        raise SystemExit(f"gpt-fast's {GPT_FAST_NAME} entry {got} is not the published config {want}")
    return args


def quantize_int8(gquant, model):
    """quantize.py's int8 mode, then generate.py's _load_model of its output, on the model's device."""
    state = gquant.WeightOnlyInt8QuantHandler(model).create_quantized_state_dict()
    with torch.device("meta"):  # the runtime modules' placeholder buffers (assign=True replaces them)
        model = gquant.WeightOnlyInt8QuantHandler(model).convert_for_runtime()
    model.load_state_dict(state, assign=True)
    return model.eval()


def model_bytes(model) -> int:
    """Bytes of every parameter and buffer but the embedding table (gpt-fast's _get_model_size)."""
    total = 0
    for _, child in model.named_children():
        if not isinstance(child, torch.nn.Embedding):
            total += sum(t.numel() * t.dtype.itemsize for t in (*child.parameters(), *child.buffers()))
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt-fast-dir", default=str(ROOT / ".peers" / "gpt-fast" / "llama"))
    ap.add_argument("--quantize", choices=("none", "int8"), default="int8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--num-samples", type=int, default=3, help="timed runs after the compile run")
    ap.add_argument("--tiny", action="store_true", help="2 small layers on the CPU: checks the code path")
    ap.add_argument("--device", default=None, help="default: cuda, cpu with --tiny")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = args.device or ("cpu" if args.tiny else "cuda")
    gen, gmodel, gquant = import_gpt_fast(Path(args.gpt_fast_dir))

    t0 = time.perf_counter()
    margs = model_args(gmodel, args.tiny)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = build_random(gmodel, margs, device, dtype)
    if args.quantize == "int8":
        model = quantize_int8(gquant, model)
    gen.device_sync(device=device)
    build_s = time.perf_counter() - t0
    nbytes = model_bytes(model)

    compile_decode_step(gen)
    torch.manual_seed(1234)
    prompt = torch.randint(3, margs.vocab_size, (args.prompt_len,), dtype=torch.int, device=device)

    def generate() -> int:
        y, _ = gen.generate(
            model, prompt, args.max_new_tokens, batch_size=1, interactive=False, draft_model=None,
            temperature=0.8, top_k=200,
        )  # fmt: skip
        return y.size(-1) - args.prompt_len

    compile_s, runs = timed_generations(gen, device, args.num_samples, generate)
    res = {
        "engine": f"gpt-fast llama ({args.quantize if args.quantize != 'none' else 'bf16'}, compiled, reduce-overhead)",
        "gpt_fast_commit": gpt_fast_commit(Path(args.gpt_fast_dir)),
        "quantize": args.quantize,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        **rate_fields(runs),
        "model_GB": nbytes / 1e9,  # gpt-fast's "Bandwidth achieved" counts these bytes a token
        "startup_s": build_s + compile_s,
        "build_s": build_s,
        "compile_run_s": compile_s,
        "max_memory_reserved_GB": torch.cuda.max_memory_reserved() / 1e9 if device.startswith("cuda") else None,
        "runs": runs,
    }
    report(res, args.out)


if __name__ == "__main__":
    main()
