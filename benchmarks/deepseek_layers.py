"""DeepSeek-V3's decode time per layer at full width, and the 61-layer model's TPOT projected from it.

The whole model (671 B parameters) fits no single GPU; its layers do. Each build is DeepSeek-V3's
published config (`checkpoints.deepseek_v3_layers`: hidden 7168, 128 heads, MLA with q LoRA 1536 and
a 512 + 64 latent, 256 experts top 8 in 8 groups keeping 4, one shared expert) with d dense and m MoE
layers, random bf16 weights, run by atomc with CUDA graphs. A build's decode step time is modelled as

    T(d, m) = R + d x t_dense + m x t_moe

(R: embedding, final norm, lm_head, sampling, host work the graphs leave), fitted by least squares
over the builds (the default three, 3+m, 3+1 and 1+1, determine it exactly: t_moe from the MoE
counts at 3 dense, t_dense from the dense counts at 1 MoE). The projection is then
R + 3 t_dense + 58 t_moe, the published model's 3 dense and 58 MoE layers. m is the most MoE
layers, 2 to 4, whose weights fit 80% of the GPU (`default_builds`: 4 on an H200 in bf16, 2 on an
80 GB H100, 4 in FP8 on either; a bf16 MoE layer holds 23 GB).

Per build and concurrency c (default 1 and 64): c requests of `--isl` distinct prompt tokens are
prefilled, then, once every step decodes all c together (the engine's last_step: c sequences, c
tokens), `--steps` steps are timed by wall clock (`step_ms`, the median: what a TPOT is); on CUDA
the captured decode graph of batch c is also replayed alone with CUDA events (`graph_ms`: GPU time,
no host work). Both are fitted. Each term is set against its roofline: the bytes that part reads
(`ceilings.moe_layer_bytes`: weights, D(c) distinct experts a MoE layer, every sequence's latent
cache at the timed context) over the copy bandwidth measured in the same call.

What the projection leaves out: no tensor or expert parallelism (the 61-layer model needs 8 GPUs:
each layer's weight reads split over them and all-reduces / all-to-alls added, so the 8-GPU TPOT is
neither this figure nor this divided by 8), no MTP speculative step, and only the contexts measured
(ISL to ISL + steps; a layer's share of the latent cache grows with the context, ~0.4% of a MoE
layer's bytes at CONC 64 and 1k tokens).

Each build runs in its own process (GPU memory is freed between them), stopped where it would eat
the `--reserve` s kept for each build after it within `--budget`; the JSON is rewritten after every
build, and a later run with the same settings and `--out` reuses the builds already there (so the
builds can be spread over calls: `--builds 3+4`, then `--builds 3+1,1+1`, then all three to fit).
`--tiny` runs the same code on the CPU at toy widths (2 layers at most, eager, a nominal bandwidth).

`--fp8` builds the layers with V3/R1's published block-FP8 quantization_config (e4m3 weights in
128 x 128 blocks, activations per 128-value group: the format DeepSeek-R1 ships in), held to those
bytes (`ceilings.mla_fp8_block_layer_bytes`: about half a layer's bf16 bytes); its builds are
their own folders and results.

    python benchmarks/deepseek_layers.py --out OUT/deepseek_layers.json
    python benchmarks/deepseek_layers.py --fp8 --out OUT/deepseek_layers_fp8.json
    python benchmarks/deepseek_layers.py --tiny [--fp8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ceilings  # noqa: E402
import decode_bs1  # noqa: E402
from checkpoints import DEEPSEEK_V3, deepseek_v3_layers, tiny_config, write_checkpoint  # noqa: E402

FULL = {"builds": None, "conc": "1,64", "isl": 1024, "warmup": 8, "steps": 64}  # builds: default_builds
TINY = {"builds": "1+1,1+0,0+1", "conc": "1,4", "isl": 16, "warmup": 2, "steps": 6}
# tokens the first-prefilled sequences may decode before the last prompt is in (one a prefill step)
PREFILL_STEPS_ROOM = 256
# the model projected to: DeepSeek-V3 as published
PROJECTED_DENSE = DEEPSEEK_V3["first_k_dense_replace"]
PROJECTED_MOE = DEEPSEEK_V3["num_hidden_layers"] - PROJECTED_DENSE


def parse_builds(text: str) -> list[tuple[int, int]]:
    """Dense + MoE layer counts: "3+4,3+1" -> [(3, 4), (3, 1)]."""
    builds = []
    for item in text.split(","):
        dense, sep, moe = item.strip().partition("+")
        if not sep or not dense.isdigit() or not moe.isdigit() or int(dense) + int(moe) < 1:
            raise SystemExit(f"--builds: {item!r} is not DENSE+MOE layer counts (e.g. 3+4), with a layer at least")
        builds.append((int(dense), int(moe)))
    return builds


def layer_weight_bytes(cfg: dict, moe: bool, fp8: bool) -> int:
    """Bytes one decoder layer of `cfg` holds (MLA projections, then the dense MLP or the routed
    and shared experts with the router): a memory-fit estimate (FP8 linears 1 byte a value, their
    block scales left out)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    q = h * cfg["q_lora_rank"] + cfg["q_lora_rank"] * heads * qk if cfg.get("q_lora_rank") else h * heads * qk
    kv = h * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    kv += cfg["kv_lora_rank"] * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
    attn = q + kv + heads * cfg["v_head_dim"] * h
    if moe:
        experts = cfg["n_routed_experts"] + cfg.get("n_shared_experts", 0)
        mlp = experts * 3 * h * cfg["moe_intermediate_size"]
        return (attn + mlp) * (1 if fp8 else 2) + cfg["n_routed_experts"] * h * 2  # the router in bf16
    return (attn + 3 * h * cfg["intermediate_size"]) * (1 if fp8 else 2)


def default_builds(gpu_bytes: int, fp8: bool) -> str:
    """The three builds (3+m, 3+1, 1+1) with m the most MoE layers, 4 at most, 2 at least, whose
    weights take at most 80% of the GPU's memory (the rest: KV cache, activations, CUDA graphs):
    3+4 on an H200 in bf16 (~99 GB), 3+2 on an 80 GB H100 (3+4 is ~99 GB), 3+4 in FP8 on either."""
    cfg = deepseek_v3_layers(1, 3)
    fixed = 3 * layer_weight_bytes(cfg, False, fp8) + 2 * cfg["vocab_size"] * cfg["hidden_size"] * 2  # embed + head
    per_moe = layer_weight_bytes(cfg, True, fp8)
    moe = max(2, min(4, int((0.8 * gpu_bytes - fixed) // per_moe)))
    return f"3+{moe},3+1,1+1"


def build_key(dense: int, moe: int) -> str:
    return f"{dense}+{moe}"


def build_config(dense: int, moe: int, tiny: bool, fp8: bool = False) -> dict:
    cfg = deepseek_v3_layers(moe, dense, fp8=fp8)
    if tiny:  # toy widths, then the layer counts asked for
        cfg = dict(tiny_config(cfg), num_hidden_layers=dense + moe, first_k_dense_replace=dense)
    return cfg


def build_dir(root: Path, dense: int, moe: int, tiny: bool, fp8: bool = False) -> Path:
    return Path(root) / f"deepseek-v3-layers-{dense}d{moe}m{'-fp8' if fp8 else ''}{'-tiny' if tiny else ''}"


# -- fitting -----------------------------------------------------------------------------------------


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b for a 3 x 3 `a` (Cramer's rule); None when `a` is singular."""

    def det(m):
        return (
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        )

    d = det(a)
    scale = max(abs(v) for row in a for v in row) ** 3
    if abs(d) <= 1e-9 * scale:
        return None
    out = []
    for col in range(3):
        m = [[b[r] if c == col else a[r][c] for c in range(3)] for r in range(3)]
        out.append(det(m) / d)
    return out


def fit_layers(points: list[tuple[int, int, float]]) -> dict | None:
    """Least squares of t = R + d x t_dense + m x t_moe over (d, m, t) points; None unless the
    points pin all three (dense and MoE counts varied independently, three builds at least).
    -> {"rest", "dense_layer", "moe_layer", "max_residual"} in the points' unit."""
    if len(points) < 3:
        return None
    rows = [(1.0, float(d), float(m)) for d, m, _ in points]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    atb = [sum(r[i] * t for r, (_, _, t) in zip(rows, points, strict=True)) for i in range(3)]
    x = _solve3(ata, atb)
    if x is None:
        return None
    rest, dense, moe = x
    residual = max(abs(rest + d * dense + m * moe - t) for d, m, t in points)
    return {"rest": rest, "dense_layer": dense, "moe_layer": moe, "max_residual": residual}


def derive(builds: dict[str, dict], concs: list[int], bandwidth: float, tiny: bool, fp8: bool = False) -> list[dict]:
    """Per concurrency: the fitted per-layer times of each series, their rooflines and the projection."""
    rows = []
    for conc in concs:
        cells = [(b["dense"], b["moe"], c) for b in builds.values() for c in b["cells"] if c["conc"] == conc]
        row = {"conc": conc, "builds": sorted(build_key(d, m) for d, m, _ in cells)}
        context = statistics.median(c["context"] for _, _, c in cells) if cells else 0
        # the roofline of each term, at the timed context, from the shape of any build (widths are shared)
        shape = build_config(PROJECTED_DENSE, PROJECTED_MOE, tiny, fp8)
        part = ceilings.moe_layer_bytes(shape, conc, int(context), weights="fp8_block" if fp8 else "bf16")
        roof_ms = {"rest": part["rest"], "dense_layer": part["dense"], "moe_layer": part["sparse"]}
        row["roofline_ms"] = {k: 1e3 * v / bandwidth for k, v in roof_ms.items()}
        row["context"] = context
        for series in ("step_ms", "graph_ms"):
            points = [(d, m, c[series]) for d, m, c in cells if c.get(series) is not None]
            fit = fit_layers(points)
            if fit is None:
                continue
            tpot = fit["rest"] + PROJECTED_DENSE * fit["dense_layer"] + PROJECTED_MOE * fit["moe_layer"]
            row[series] = {
                **fit,
                "projected_tpot_ms": tpot,
                "projected_tok_s": 1e3 * conc / tpot if tpot > 0 else None,
                # how far each layer is from its bytes at the measured bandwidth
                "dense_layer_roofline_pct": _pct(row["roofline_ms"]["dense_layer"], fit["dense_layer"]),
                "moe_layer_roofline_pct": _pct(row["roofline_ms"]["moe_layer"], fit["moe_layer"]),
            }
        r = row["roofline_ms"]
        row["projected_roofline_tpot_ms"] = (
            r["rest"] + PROJECTED_DENSE * r["dense_layer"] + PROJECTED_MOE * r["moe_layer"]
        )
        if "step_ms" not in row:
            row["note"] = "no fit: the builds must vary the dense and the MoE layer counts independently (3 at least)"
        rows.append(row)
    return rows


def _pct(roofline_ms: float, measured_ms: float) -> float | None:
    return 100 * roofline_ms / measured_ms if measured_ms > 0 else None


# -- one build, in its own process -------------------------------------------------------------------


def decoding_all(last_step: dict, conc: int) -> bool:
    """The last launched step decoded every one of the `conc` sequences (one token each) and nothing else."""
    return last_step.get("num_seqs") == conc and last_step.get("num_tokens") == conc


def time_decode(engine, conc: int, isl: int, warmup: int, steps: int, vocab: int, device: str) -> dict:
    """Prefill `conc` distinct prompts, then time `steps` steps in which all of them decode."""
    from atomc import SamplingParams

    # the first sequences prefilled decode while the others prefill, so they run ahead of the timed
    # window: no token limit below the model length (they are aborted after it)
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - isl, ignore_eos=True)
    ids = [f"c{conc}-{i}" for i in range(conc)]
    for i, rid in enumerate(ids):  # distinct prompts: no prefix-cache sharing between the sequences
        engine.add_request(rid, [(1000 + 7919 * i + j) % vocab for j in range(isl)], params)
    try:
        for _ in range(isl * conc + 16):  # the prefill, chunked or not, ends well within this
            engine.step()
            if decoding_all(engine.last_step, conc):
                break
        else:
            raise RuntimeError(f"CONC {conc}: the steps never became pure decode steps of all sequences")
        for _ in range(warmup):
            engine.step()
        walls = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
            if not decoding_all(engine.last_step, conc):
                raise RuntimeError(
                    f"CONC {conc}: a timed step was not a decode step of all sequences: {engine.last_step}"
                )
        graph_ms = replay_ms(engine, conc) if device.startswith("cuda") else None
    finally:
        for rid in ids:
            engine.abort_request(rid)
    return {
        "conc": conc,
        "context": isl + warmup + steps // 2,  # mid-window
        "step_ms": 1e3 * statistics.median(walls),
        "step_ms_mean": 1e3 * statistics.fmean(walls),
        "graph_ms": graph_ms,
    }


def replay_ms(engine, conc: int, iters: int = 20) -> float | None:
    """GPU time of the captured decode graph of batch `conc`, replayed on its last inputs."""
    import torch

    graphs = engine.runner.decode_graphs
    key = graphs.key_for(conc, 1) if graphs is not None else None
    if key is None or key not in graphs.graphs:
        return None
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.graphs[key].replay()  # once untimed
    start.record()
    for _ in range(iters):
        graphs.graphs[key].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run_build(args, dense: int, moe: int) -> dict:
    from atomc import LLM

    device = "cpu" if args.tiny else "cuda"
    cfg = build_config(dense, moe, args.tiny, args.fp8)
    concs = [int(c) for c in args.conc.split(",")]
    t0 = time.perf_counter()
    llm = LLM(
        model=str(build_dir(args.root, dense, moe, args.tiny, args.fp8)), dtype="float32" if args.tiny else "bfloat16",
        device=device, load_format="dummy", max_model_len=args.isl + args.warmup + args.steps + PREFILL_STEPS_ROOM,
        max_num_seqs=max(concs), enforce_eager=args.tiny,
    )  # fmt: skip
    startup = time.perf_counter() - t0
    cells = [time_decode(llm.engine, c, args.isl, args.warmup, args.steps, cfg["vocab_size"], device) for c in concs]
    graphs = llm.engine.runner.decode_graphs
    return {
        "dense": dense,
        "moe": moe,
        "startup_s": startup,
        "cuda_graphs": bool(graphs is not None and graphs.graphs),
        "cells": cells,
    }


# -- the driver --------------------------------------------------------------------------------------


def settings_of(args) -> dict:
    """What a build's numbers depend on: builds measured under other settings are not reused."""
    return {"tiny": args.tiny, "fp8": args.fp8, "conc": args.conc, "isl": args.isl, "warmup": args.warmup,
            "steps": args.steps}  # fmt: skip


def previous_builds(out: Path | None, settings: dict) -> dict[str, dict]:
    if out is None or not out.is_file():
        return {}
    try:
        old = json.loads(out.read_text())
    except json.JSONDecodeError:
        return {}
    return dict(old.get("builds", {})) if old.get("settings") == settings else {}


def report(res: dict) -> str:
    lines = [
        f"DeepSeek-V3 width, per-layer decode time ({'tiny, CPU' if res['settings']['tiny'] else 'CUDA graphs'}), "
        f"ISL {res['settings']['isl']}, {res['bandwidth_TBps']:.2f} TB/s"
    ]
    for key, b in sorted(res["builds"].items()):
        if "error" in b:
            lines.append(f"  build {key}: ERROR {b['error'][-300:]}")
            continue
        cells = ", ".join(
            f"CONC {c['conc']} step {c['step_ms']:.3f} ms" + (f" (graph {c['graph_ms']:.3f})" if c["graph_ms"] else "")
            for c in b["cells"]
        )
        lines.append(f"  build {key} (dense+MoE): {cells}; start-up {b['startup_s']:.0f} s")
    for row in res["per_layer"]:
        r = row["roofline_ms"]
        lines.append(f"  CONC {row['conc']} (roofline: dense {r['dense_layer']:.3f} ms, MoE {r['moe_layer']:.3f} ms, "
                     f"rest {r['rest']:.3f} ms; 61 layers {row['projected_roofline_tpot_ms']:.2f} ms)")  # fmt: skip
        for series in ("step_ms", "graph_ms"):
            f = row.get(series)
            if f:
                lines.append(
                    f"    {series}: dense layer {f['dense_layer']:.3f} ms, MoE layer {f['moe_layer']:.3f} ms, "
                    f"rest {f['rest']:.3f} ms (residual {f['max_residual']:.3f}) -> 61 layers "
                    f"{f['projected_tpot_ms']:.2f} ms a step"
                    + (f", {f['projected_tok_s']:.0f} tok/s" if f["projected_tok_s"] else "")
                )
        if "note" in row:
            lines.append(f"    {row['note']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fits = "3+m,3+1,1+1, m the MoE layers that fit, 2 to 4"
    ap.add_argument("--builds", default=None, help=f"DENSE+MOE,... (default {fits}; --tiny {TINY['builds']})")
    ap.add_argument("--conc", default=None, help=f"concurrencies (default {FULL['conc']}; --tiny {TINY['conc']})")
    ap.add_argument("--isl", type=int, default=None, help=f"prompt tokens (default {FULL['isl']})")
    ap.add_argument("--warmup", type=int, default=None, help="decode steps before the timed ones")
    ap.add_argument("--steps", type=int, default=None, help=f"timed decode steps (default {FULL['steps']})")
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--budget", type=float, default=570, help="seconds for the whole run, from its start")
    ap.add_argument("--reserve", type=float, default=120, help="seconds kept back for each build still to run")
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s; default: measured (nominal with --tiny)")
    ap.add_argument("--fresh", action="store_true", help="measure every build even if --out holds it")
    ap.add_argument("--tiny", action="store_true", help="the same code on the CPU at toy widths")
    ap.add_argument("--fp8", action="store_true", help="the published block-FP8 quantization_config (DeepSeek-R1's)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    started = time.monotonic()
    defaults = TINY if args.tiny else FULL
    for key in ("builds", "conc", "isl", "warmup", "steps"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.child:
        ((dense, moe),) = parse_builds(args.child)
        print("RESULT " + json.dumps(run_build(args, dense, moe)), flush=True)
        return
    if args.builds is None:  # the full widths on this GPU (TINY names its builds)
        import torch

        args.builds = default_builds(torch.cuda.get_device_properties(0).total_memory, args.fp8)
    builds = parse_builds(args.builds)
    concs = [int(c) for c in args.conc.split(",")]
    for dense, moe in builds:  # before any child: they would race for the folders
        folder = build_dir(args.root, dense, moe, args.tiny, args.fp8)
        write_checkpoint(build_config(dense, moe, args.tiny, args.fp8), folder)
    bw = args.bandwidth or (decode_bs1.NOMINAL_CPU_BANDWIDTH if args.tiny else ceilings.measure()["bandwidth"])
    out = Path(args.out) if args.out else None
    settings = settings_of(args)
    done = {} if args.fresh else previous_builds(out, settings)
    model = "deepseek-v3-layers" + ("-fp8" if args.fp8 else "")
    res = {"model": model, "settings": settings, "bandwidth_TBps": bw / 1e12,
           "projected": {"dense": PROJECTED_DENSE, "moe": PROJECTED_MOE}, "builds": done, "per_layer": []}  # fmt: skip
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    todo = [b for b in builds if build_key(*b) not in done or "error" in done[build_key(*b)]]
    for key in sorted(set(done) - {build_key(*b) for b in todo}):
        print(f"reusing build {key} from {out}", flush=True)
    for i, (dense, moe) in enumerate(todo):
        key = build_key(dense, moe)
        timeout = decode_bs1.child_timeout(args.budget, time.monotonic() - started, args.reserve, len(todo) - 1 - i)
        cmd = [sys.executable, __file__, "--child", key, "--root", str(args.root), "--conc", args.conc,
               "--isl", str(args.isl), "--warmup", str(args.warmup), "--steps", str(args.steps)]  # fmt: skip
        log = out.with_name(f"{out.stem}.{dense}d{moe}m.log") if out else None
        cmd += (["--tiny"] if args.tiny else []) + (["--fp8"] if args.fp8 else [])
        got, tail = decode_bs1.run_child(cmd, timeout, log)
        res["builds"][key] = got if got is not None else {"dense": dense, "moe": moe, "error": tail}
        ok = {k: b for k, b in res["builds"].items() if "error" not in b}
        res["per_layer"] = derive(ok, concs, bw, args.tiny, args.fp8)
        if out:  # after every build: a later one failing or timing out keeps the numbers so far
            out.write_text(json.dumps(res, indent=2))
    measured = {k: b for k, b in res["builds"].items() if "error" not in b}
    res["per_layer"] = derive(measured, concs, bw, args.tiny, args.fp8)
    if out:
        out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    print()
    print(report(res))
    sys.exit(1 if any("error" in b for b in res["builds"].values()) else 0)


if __name__ == "__main__":
    main()
