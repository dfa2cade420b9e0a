"""What the gpt-fast peers (gpt_fast_llama.py, gpt_fast_mixtral.py) share: compiling gpt-fast's
decode step as its generate.py does with --compile, and timing its generate() the way it reports.
"""

from __future__ import annotations

import json
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch


def import_path(folder: Path, files: tuple[str, ...]) -> None:
    """Put gpt-fast's `folder` on sys.path, after checking it holds `files`, with stand-ins for the
    tokenizer packages its modules import when they are not installed (random ids need no tokenizer)."""
    for f in files:
        if not (folder / f).is_file():
            raise SystemExit(f"{folder} has no gpt-fast {f}: run benchmarks/peers/fetch_gpt_fast.sh")
    sys.path.insert(0, str(folder))
    for name, attrs in (("sentencepiece", ("SentencePieceProcessor",)), ("tiktoken", ())):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
            for a in attrs:
                setattr(sys.modules[name], a, None)
            if name == "tiktoken":
                load = types.ModuleType("tiktoken.load")
                load.load_tiktoken_bpe = None
                sys.modules["tiktoken.load"] = load


def build_random(gmodel, args, device: str, dtype: torch.dtype):
    """gpt-fast's Transformer with random weights on `device` (norm weights 1)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = gmodel.Transformer(args)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def compile_decode_step(gen) -> None:
    """gen.decode_one_token compiled (reduce-overhead, fullgraph), handing back copies of its outputs:
    generate.py feeds each step's token (a view of the CUDA graph's output) to the next step, and
    torch 2.11 refuses to read an output the next replay overwrites (two tiny copies a token, about
    10 us against a step of several ms)."""
    compiled = torch.compile(gen.decode_one_token, mode="reduce-overhead", fullgraph=True)

    def decode_one_token(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return tuple(t.clone() for t in compiled(*args, **kwargs))

    gen.decode_one_token = decode_one_token


def timed_generations(gen, device: str, num_samples: int, generate: Callable[[], int]) -> tuple[float, list[dict]]:
    """One untimed-for-speed compile run, then `num_samples` runs of `generate()` (which returns the
    tokens it produced), each from a device sync to a device sync. Returns (compile run s, runs)."""
    compile_s, runs = 0.0, []
    for i in range(-1, num_samples):
        gen.device_sync(device=device)
        t0 = time.perf_counter()
        tokens = generate()
        gen.device_sync(device=device)
        t = time.perf_counter() - t0
        if i == -1:
            compile_s = t
            continue
        runs.append({"total_s": t, "tokens": tokens, "e2e_tok_s": tokens / t})
    return compile_s, runs


def rate_fields(runs: list[dict]) -> dict:
    rates = [r["e2e_tok_s"] for r in runs]
    # mean: what gpt-fast prints as "Average tokens/sec"
    return {"e2e_tok_s": max(rates), "mean_tok_s": sum(rates) / len(rates)}


def report(res: dict, out: str | None) -> None:
    print("RESULT " + json.dumps(res), flush=True)
    if out:
        Path(out).write_text(json.dumps(res, indent=2))


def gpt_fast_commit(folder: Path) -> str | None:
    f = folder / "COMMIT"
    return f.read_text().strip() if f.is_file() else None
