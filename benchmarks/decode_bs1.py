"""Batch-1 decode (128 tokens in, 512 out): atomc next to transformers (static cache, auto torch.compile).

Each engine runs in its own process on the same GPU, one after the other. Weights are random
(bf16) with the real model shape, so bytes moved per token are the real ones. The roofline is
weight bytes per token over the copy bandwidth measured in the same call (`ceilings.py`), counted
per engine for the bytes its weights take: bf16; FP8 for atomc's online `--quantization fp8`
(per-channel e4m3 linears with fp32 row scales, dynamic per-token activations; the LM head stays
bf16); int8 for gpt-fast's weight-only int8 (every nn.Linear, the LM head too, bf16 row scales).

Engines (`--engines`, comma-separated, run in that order):
- `atomc`, `atomc-eager`: the model as the checkpoint is; `atomc-fp8`, `atomc-fp8-eager`: the same
  with `quantization="fp8"` (what `atomc serve --quantization fp8` sets: EngineConfig.quantization);
- `hf` (transformers, `generate` compiling a static cache), `hf-eager` (`generate` with its default
  dynamic cache, nothing compiled: transformers as most users run it, and the peer for models whose
  static-cache compile does not finish in a box, e.g. GPT-OSS), `hf-loop` (a gpt-fast-style loop);
- `gpt-fast-int8`: gpt-fast's own Llama with its `int8` weight-only quantisation
  (`peers/gpt_fast_llama.py`; needs `.peers/gpt-fast/llama/` from `peers/fetch_gpt_fast.sh`).

Each engine's process is stopped where it would eat the `--reserve` s kept for each engine after it
(within `--budget` s from the start), its output goes to `OUT.<engine>.log`, and the JSON is
rewritten after every engine, so a hang or a crash keeps the numbers before it. `--tiny` runs the
same code on the CPU with the 2-layer toy config, short prompts and a nominal bandwidth (a smoke
test before GPU time; the percentages are then meaningless).

    python benchmarks/decode_bs1.py --model llama-3.1-8b --engines atomc,atomc-fp8 --out results.json
    python benchmarks/decode_bs1.py --engines atomc-eager,atomc-fp8-eager --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ceilings  # noqa: E402
from checkpoints import make_checkpoint, model_config, weight_bytes  # noqa: E402
from tree_env import child_env  # noqa: E402

PROMPT_LEN, OUTPUT_LEN = 128, 512
TINY_LENS = (16, 24)  # prompt, output tokens under --tiny
NOMINAL_CPU_BANDWIDTH = 20e9  # --tiny: no GPU copy to measure; the % is then only a smoke value
# engine -> (what runs, enforce_eager, weight format for the roofline)
ENGINES = {
    "atomc": ("atomc", False, "bf16"),
    "atomc-eager": ("atomc", True, "bf16"),
    "atomc-no-pdl": ("atomc", False, "bf16"),  # --no-enable-pdl: the PDL A/B in one call
    "atomc-fp8-no-pdl": ("atomc", False, "fp8"),
    "atomc-one-shot-ar": ("atomc", False, "bf16"),  # --one-shot-all-reduce (with -tp N): its A/B in one call
    "atomc-ep": ("atomc", False, "bf16"),  # --enable-expert-parallel (MoE, with -tp N): TP against EP in one call
    "atomc-fp8": ("atomc", False, "fp8"),
    "atomc-fp8-eager": ("atomc", True, "fp8"),
    "hf": ("hf", None, "bf16"),
    "hf-eager": ("hf-eager", None, "bf16"),
    "hf-loop": ("hf-loop", None, "bf16"),
    "gpt-fast-int8": ("gpt-fast", None, "int8"),
}
GPT_FAST_LLAMA = HERE.parent / ".peers" / "gpt-fast" / "llama"


def roofline_bytes(model: str | dict, weights: str) -> int:
    """Weight bytes one token streams in the engine's weight format (module docstring)."""
    if weights == "fp8":
        return weight_bytes(model, linear_bytes=1, row_scale_bytes=4)
    if weights == "int8":
        return weight_bytes(model, linear_bytes=1, quantized_lm_head=True, row_scale_bytes=2)
    return weight_bytes(model)


def run_child(cmd: list[str], timeout: float, log: Path | None) -> tuple[dict | None, str]:
    """Run one engine's process (in its own session, so a timeout also ends its compile workers);
    returns (its RESULT json or None, the tail of its output)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=child_env(PYTHONUNBUFFERED="1"),  # this tree's atomc, whatever the caller exported
    )  # fmt: skip

    def stop(signum, frame):  # a timeout around this script must not leave an engine holding the GPU
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    # the default --budget (1e9 s) is past what poll() takes: an OverflowError there once left the
    # engine running on the GPU beside the next call's (every run of that call read half speed)
    timeout = min(timeout, 1e6)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[killed after {timeout:.0f} s]"
    except BaseException:  # anything else: no engine outlives this script
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if log is not None:
        log.write_text(out)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return None, out[-3000:]
    return json.loads(lines[-1][len("RESULT ") :]), out[-3000:]


def child_timeout(budget: float, elapsed: float, reserve: float, engines_after: int) -> float:
    """What is left of the budget but the reserve of each engine after this one (30 s at least)."""
    return max(budget - elapsed - reserve * engines_after, 30.0)


def prompt_ids(n: int, vocab: int) -> list[int]:
    """n token ids from 1000 on (wrapped into a small vocabulary)."""
    return [(1000 + i) % vocab for i in range(n)]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_atomc(
    model_dir: str, enforce_eager: bool, device: str = "cuda", prompt_len: int = PROMPT_LEN,
    output_len: int = OUTPUT_LEN, vocab: int = 1 << 30, quantization: str | None = None, enable_pdl: bool = True,
    tensor_parallel_size: int = 1, one_shot_all_reduce: bool = False, enable_expert_parallel: bool = False,
) -> dict:  # fmt: skip
    """`quantization` is EngineConfig.quantization (the CLI's --quantization): None or "fp8";
    `enable_pdl` is CompileConfig.enable_pdl (--enable-pdl); `tensor_parallel_size` is -tp;
    `one_shot_all_reduce` is --one-shot-all-reduce, `enable_expert_parallel` --enable-expert-parallel."""
    from atomc import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir,
        dtype="bfloat16" if device.startswith("cuda") else "float32",
        device=device,
        load_format="dummy",
        max_model_len=1024,
        max_num_seqs=8,
        enforce_eager=enforce_eager,
        quantization=quantization,
        enable_pdl=enable_pdl,
        tensor_parallel_size=tensor_parallel_size,
        one_shot_all_reduce=one_shot_all_reduce,
        enable_expert_parallel=enable_expert_parallel,
    )
    startup = time.perf_counter() - t0
    prompt = {"prompt_token_ids": prompt_ids(prompt_len, vocab)}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))  # warm-up
    _sync(device)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))[0]
        total = time.perf_counter() - t0
        m = out.metrics
        decode = m["finish_time"] - m["first_token_time"]
        runs.append({"total_s": total, "decode_tok_s": (output_len - 1) / decode, "e2e_tok_s": output_len / total})
    best = max(runs, key=lambda r: r["decode_tok_s"])
    name = "atomc" + (f" {quantization}" if quantization else "") + (" (eager)" if enforce_eager else "")
    name += ("" if enable_pdl else " (no PDL)") + (f" TP={tensor_parallel_size}" if tensor_parallel_size > 1 else "")
    name += (" EP" if enable_expert_parallel else "") + (" one-shot all-reduce" if one_shot_all_reduce else "")
    return {"engine": name, "quantization": quantization, "enable_pdl": enable_pdl, "startup_s": startup, **best,
            "runs": runs}  # fmt: skip


def run_hf(
    model_dir: str, device: str = "cuda", prompt_len: int = PROMPT_LEN, output_len: int = OUTPUT_LEN,
    vocab: int = 1 << 30, static_cache: bool = True,
) -> dict:  # fmt: skip
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    # a static cache makes generate() compile the forward itself (fullgraph, reduce-overhead);
    # without one it runs eagerly over its dynamic cache
    ids = torch.tensor(prompt_ids(prompt_len, vocab), device=device)[None]
    gen = dict(do_sample=False, pad_token_id=0)
    if static_cache:
        gen["cache_implementation"] = "static"
    for _ in range(2):  # compile + capture (static), warm-up (eager)
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **gen)
    startup = time.perf_counter() - t0
    runs = []
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **gen)
        _sync(device)
        total = time.perf_counter() - t0
        runs.append({"total_s": total, "e2e_tok_s": output_len / total})
    best = max(runs, key=lambda r: r["e2e_tok_s"])
    name = "transformers static cache (generate compiles it)" if static_cache else "transformers eager, dynamic cache"
    return {"engine": name, "startup_s": startup, **best, "runs": runs}


def run_hf_loop(model_dir: str) -> dict:
    """gpt-fast style: a static cache and a hand-written decode loop over a torch.compile'd step."""
    import torch
    import transformers
    from transformers import StaticCache

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    cache = StaticCache(config=cfg, max_cache_len=PROMPT_LEN + OUTPUT_LEN + 8)

    def step(ids, pos):
        return model(input_ids=ids, cache_position=pos, past_key_values=cache, use_cache=True).logits[:, -1]

    step_c = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    ids = torch.arange(1000, 1000 + PROMPT_LEN, device="cuda")[None]

    @torch.inference_mode()
    def generate() -> None:
        cache.reset()
        tok = step(ids, torch.arange(PROMPT_LEN, device="cuda")).argmax(-1, keepdim=True)
        for i in range(OUTPUT_LEN - 1):
            torch.compiler.cudagraph_mark_step_begin()
            tok = step_c(tok, torch.tensor([PROMPT_LEN + i], device="cuda")).argmax(-1, keepdim=True).clone()
        torch.cuda.synchronize()

    for _ in range(2):
        generate()
    startup = time.perf_counter() - t0
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        generate()
        total = time.perf_counter() - t0
        runs.append({"total_s": total, "e2e_tok_s": OUTPUT_LEN / total})
    best = max(runs, key=lambda r: r["e2e_tok_s"])
    return {"engine": "transformers static cache + torch.compile loop", "startup_s": startup, **best, "runs": runs}


def child_command(args, engine: str) -> list[str]:
    if engine not in ENGINES:
        raise SystemExit(f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")
    tp = getattr(args, "tensor_parallel_size", 1)
    if ENGINES[engine][0] != "atomc" and tp > 1:
        raise SystemExit(f"{engine} runs on one GPU: --tensor-parallel-size applies to the atomc engines only")
    if ENGINES[engine][0] == "gpt-fast":
        if args.model != "llama-3.1-8b":
            raise SystemExit("the gpt-fast int8 peer is its Llama-3.1-8B entry: --model llama-3.1-8b only")
        cmd = [sys.executable, str(HERE / "peers" / "gpt_fast_llama.py"), "--quantize", "int8",
               "--prompt-len", str(args.prompt_len), "--max-new-tokens", str(args.output_len)]  # fmt: skip
        return cmd + (["--tiny"] if args.tiny else [])
    cmd = [sys.executable, __file__, "--model", args.model, "--root", args.root, "--child", engine,
           "--tensor-parallel-size", str(tp)]  # fmt: skip
    return cmd + (["--tiny"] if args.tiny else [])


def run_atomc_engine(engine: str, model_dir: str, device: str, **kwargs) -> dict:
    """`run_atomc` as an atomc row of ENGINES names it: eager or not, its weights' format, and
    PDL off for the `-no-pdl` twins, the one-shot all-reduce for `-one-shot-ar`, expert parallelism
    for `-ep`."""
    _, eager, weights = ENGINES[engine]
    return run_atomc(model_dir, eager, device=device, quantization="fp8" if weights == "fp8" else None,
                     enable_pdl=not engine.endswith("-no-pdl"), one_shot_all_reduce=engine.endswith("-one-shot-ar"),
                     enable_expert_parallel=engine.endswith("-ep"), **kwargs)  # fmt: skip


def run_engine_here(args, engine: str) -> dict:
    kind = ENGINES[engine][0]
    model_dir = str(make_checkpoint(args.model, Path(args.root), tiny=args.tiny))
    device = "cpu" if args.tiny else "cuda"
    lens = dict(prompt_len=args.prompt_len, output_len=args.output_len,
                vocab=model_config(args.model, args.tiny)["vocab_size"])  # fmt: skip
    if kind == "atomc":
        return run_atomc_engine(engine, model_dir, device, tensor_parallel_size=args.tensor_parallel_size, **lens)
    if kind in ("hf", "hf-eager"):
        return run_hf(model_dir, device=device, static_cache=kind == "hf", **lens)
    if kind == "hf-loop":
        if args.tiny:
            raise SystemExit("hf-loop runs on CUDA only")
        return run_hf_loop(model_dir)
    raise SystemExit(f"engine {engine!r} does not run in this script's process")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--engines", default="atomc,hf", help="comma-separated, of: " + ", ".join(ENGINES))
    ap.add_argument("--budget", type=float, default=1e9, help="seconds for the whole run, from its start")
    ap.add_argument("--reserve", type=float, default=100, help="seconds kept back for each engine still to run")
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s; default: measured (nominal with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="the same code on the CPU, 2 small layers, short prompts")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="the atomc engines over N GPUs; the roofline is then N GPUs' bandwidth")  # fmt: skip
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    started = time.monotonic()
    args.prompt_len, args.output_len = TINY_LENS if args.tiny else (PROMPT_LEN, OUTPUT_LEN)
    if args.child:
        print("RESULT " + json.dumps(run_engine_here(args, args.child)), flush=True)
        return
    engines = args.engines.split(",")
    for engine in engines:
        child_command(args, engine)  # an unknown engine fails before any GPU time is spent
    make_checkpoint(args.model, Path(args.root), tiny=args.tiny)  # once, before the children race for it
    cfg = model_config(args.model, args.tiny)
    bw = args.bandwidth or (NOMINAL_CPU_BANDWIDTH if args.tiny else ceilings.measure()["bandwidth"])
    # TP: each GPU reads its shard of the weights, so N GPUs' bandwidth bounds the token rate
    tp = args.tensor_parallel_size
    rooflines = {w: tp * bw / roofline_bytes(cfg, w) for w in ("bf16", "fp8", "int8")}
    results = {
        "model": args.model + (" (tiny)" if args.tiny else ""),
        "tensor_parallel_size": tp,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "bandwidth_TBps": bw / 1e12,
        "roofline_tok_s": rooflines["bf16"],
        "rooflines_tok_s": rooflines,
        "weight_GB": {w: roofline_bytes(cfg, w) / 1e9 for w in rooflines},
        "engines": [],
        "speedups": {},
    }
    out = Path(args.out) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    for i, engine in enumerate(engines):
        log = out.with_name(f"{out.stem}.{engine}.log") if out else None
        if ENGINES[engine][0] == "gpt-fast" and not (GPT_FAST_LLAMA / "generate.py").is_file():
            msg = f"skipped: {GPT_FAST_LLAMA} is missing (run benchmarks/peers/fetch_gpt_fast.sh and carry .peers/)"
            print(f"{engine}: {msg}", file=sys.stderr)
            results["engines"].append({"engine": engine, "skipped": msg})
        else:
            timeout = child_timeout(args.budget, time.monotonic() - started, args.reserve, len(engines) - 1 - i)
            results["engines"].append(
                engine_row(engine, *run_child(child_command(args, engine), timeout, log), rooflines)
            )
        results["speedups"] = speedups(results["engines"])
        if out:  # after every engine: a later one failing or timing out keeps the numbers so far
            out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    at_tp = f" at TP={tp}" if tp > 1 else ""
    print(f"\n{results['model']} batch-1 decode{at_tp}, roofline {rooflines['bf16']:.0f} tok/s bf16, "
          f"{rooflines['fp8']:.0f} fp8, {rooflines['int8']:.0f} int8 at {bw / 1e12:.2f} TB/s")  # fmt: skip
    for r in results["engines"]:
        if "error" in r or "skipped" in r:
            print(f"  {r['engine']:45s} {'ERROR ' + r['error'][-300:] if 'error' in r else r['skipped']}")
        else:
            print(
                f"  {r['engine']:45s} decode {r.get('decode_tok_s', r['e2e_tok_s']):7.1f} tok/s "
                f"({r['roofline_pct']:.0f}% of its {r['weights']} roofline), e2e {r['e2e_tok_s']:.1f} tok/s, "
                f"startup {r['startup_s']:.1f} s"
            )
    for name, ratio in results["speedups"].items():
        print(f"  {name}: {ratio:.2f}x")
    sys.exit(1 if any("error" in r for r in results["engines"]) else 0)


def engine_row(engine: str, res: dict | None, tail: str, rooflines: dict, engines: dict | None = None) -> dict:
    """An engine's JSON entry: its result with its roofline share, or its output's tail. `engines`:
    the script's engine table (decode_bs1_moe.py passes its own), this one's by default."""
    weights = (engines or ENGINES)[engine][2]
    if res is None:
        return {"engine": engine, "weights": weights, "error": tail}
    res.update(key=engine, weights=weights, roofline_tok_s=rooflines[weights])
    res["roofline_pct"] = 100 * res.get("decode_tok_s", res["e2e_tok_s"]) / rooflines[weights]
    return res


def speedups(engines: list[dict]) -> dict:
    """Each quantised atomc engine's decode rate over its bf16 counterpart's (eager with eager), and
    atomc's over itself without PDL."""
    rate = {r["key"]: r.get("decode_tok_s", r["e2e_tok_s"]) for r in engines if "key" in r}
    pairs = (("atomc-fp8", "atomc"), ("atomc-fp8-eager", "atomc-eager"), ("gpt-fast-int8", "atomc"),
             ("atomc", "atomc-no-pdl"), ("atomc-fp8", "atomc-fp8-no-pdl"), ("atomc-one-shot-ar", "atomc"),
             ("atomc-ep", "atomc"))  # fmt: skip
    return {f"{a} / {b}": rate[a] / rate[b] for a, b in pairs if a in rate and b in rate}


if __name__ == "__main__":
    main()
