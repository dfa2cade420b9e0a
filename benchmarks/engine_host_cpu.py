"""Host-side cost of one engine step, without the model: where the CPU time of a decode step goes.

With `--stub launch` the model runner's launch is replaced by a stub that returns a token per
sampled row at once; everything else a serving step does on the host runs for real: scheduling,
the step record (ids, positions, KV slots, block tables, sampling rows), appending tokens,
detokenizing, stop checks, building the outputs, and, as the engine process does, encoding the
per-step deltas and pickling them for the pipe. `--stub model` also keeps the runner's own host
work (the decode graphs' staging fill without capture, the feed, the sampler): only the model is
stubbed. Runs on any machine (CPU); the numbers are CPU time the GPU would otherwise wait for.

    python benchmarks/engine_host_cpu.py --running 64,256 --context 1024 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pickle
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


PARTS = ("schedule", "launch", "complete")


def stub_launch(runner):
    """Replace the runner's launch: a token per sampled row at once (the engine still builds the
    real StepInput: the flat batch, KV slots, block tables, sampling rows)."""
    import torch

    from atomc.runtime.model_runner import PendingStep
    from atomc.runtime.sampler import PendingSample

    def launch(step):
        tokens = [(step.num_tokens + i) % 300 + 10 for i in range(len(step.sample_rows))]
        return PendingStep(PendingSample(torch.tensor(tokens), [], [], []), {}) if tokens else None

    return launch


def stub_model(runner, max_seqs: int) -> None:
    """Keep the real runner launch (batch build, decode-graph staging, feed, sampler) and replace only
    the model: the forward returns zeros and the decode graphs run it without capture."""
    import torch

    from atomc.runtime.cudagraph import DecodeGraphs

    vocab = runner.arch.vocab_size
    runner.forward = lambda ids, pos: torch.zeros(ids.shape[0], 1)  # the stubbed logits ignore it
    runner.model.compute_logits = lambda h: torch.zeros(h.shape[0], vocab)
    max_blocks = (runner.max_model_len + runner.block_size - 1) // runner.block_size
    runner.decode_graphs = DecodeGraphs(
        runner.forward, runner.model.compute_logits, runner.kv_caches, [max_seqs], max_blocks,
        runner.max_model_len, "cpu", capture=False,
    )  # fmt: skip


def main() -> None:
    from conftest import build_checkpoint

    from atomc import SamplingParams
    from atomc.config import EngineConfig
    from atomc.engine.llm_engine import LLMEngine
    from atomc.engine.process import OutputDeltas

    ap = argparse.ArgumentParser()
    ap.add_argument("--running", default="64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--stub", choices=("launch", "model"), default="launch",
        help="launch: replace the whole runner launch; model: only the model "
        "(real batch build, graph staging, sampler)",
    )  # fmt: skip
    ap.add_argument("--work-dir", default="/tmp/atomc-engine-host")
    args = ap.parse_args()
    import torch

    # the host work of a step is one Python thread; torch's intra-op threads only add noise from
    # the stub's small CPU ops (on a GPU those run on the device)
    torch.set_num_threads(1)
    model_dir = build_checkpoint("llama", Path(args.work_dir))
    cfg_path = model_dir / "config.json"  # the tiny test model: allow long contexts (RoPE has no limit)
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json["max_position_embeddings"] = 1 << 16
    cfg_path.write_text(json.dumps(cfg_json))
    rows = []
    for n in (int(x) for x in args.running.split(",")):
        cfg = EngineConfig(device="cpu")
        cfg.model.model, cfg.model.max_model_len = str(model_dir), args.context + args.steps + 64
        cfg.compile.enforce_eager = True
        cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens = n, 1 << 20
        cfg.cache.num_kv_blocks = n * ((args.context + args.steps + 64) // 16 + 2)
        eng = LLMEngine(cfg)
        if args.stub == "launch":
            eng.runner.launch = stub_launch(eng.runner)
        else:
            stub_model(eng.runner, n)
        params = SamplingParams(temperature=0, max_tokens=args.steps + 10, ignore_eos=True)
        for i in range(n):
            eng.add_request(str(i), [10 + (i + j) % 300 for j in range(args.context)], params)
        eng.step()  # the whole prefill in one step
        deltas = OutputDeltas()
        steps, encodes, parts = [], [], []
        prof = cProfile.Profile() if args.profile else None
        for _ in range(args.steps):
            if prof:
                prof.enable()
            t0 = time.perf_counter()
            outs = eng.step()
            t1 = time.perf_counter()
            pickle.dumps([deltas.encode(o) for o in outs], protocol=pickle.HIGHEST_PROTOCOL)
            t2 = time.perf_counter()
            if prof:
                prof.disable()
            steps.append(t1 - t0)
            encodes.append(t2 - t1)
            parts.append(dict(eng.last_step))
        row = {
            "running": n,
            "stub": args.stub,
            "context": args.context,
            "step_ms": 1e3 * statistics.median(steps),
            "encode_pickle_ms": 1e3 * statistics.median(encodes),
            # medians over the steps, like step_ms (one step alone is noisy on a shared machine)
            **{f"{k}_ms": 1e3 * statistics.median(p[f"{k}_s"] for p in parts) for k in PARTS},
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            print(s.getvalue())


if __name__ == "__main__":
    main()
