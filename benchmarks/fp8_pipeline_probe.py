"""Where an FP8 model's CUDA run leaves the CPU reference: each quantised linear's output, in order.

A diagnostic for the GPU test `tests/quant/test_fp8_models.py::test_cuda_pipeline_runs_the_fp8_kernels`
(its tiny FP8 Llamas). Both models run eagerly in fp32 on the same tokens, the CUDA one on the ops'
CUDA kernels (Triton FP8 GEMV at one row, _scaled_mm / the Triton GEMM above). For each linear it
prints two errors relative to the reference output's largest value:
- `carried`: the GPU output against the CPU model's (what the test compares, at the logits);
- `local`: the GPU output against the CPU layer run on the GPU layer's own input, so the error
  of this one kernel, without what earlier layers carried into it.
A kernel that is wrong shows a large local error; rounding flips of the FP8 activation quant show
small local errors that grow layer by layer in the carried column.

Then (`--compiled`, as the test runs it) the GPU model through torch.compile and atomc's CUDA pass
pipeline, once with every pass and once without each FP8-related pass in turn: a pass whose removal
brings the logits back names the kernel at fault.

    python benchmarks/fp8_pipeline_probe.py [--formats hf-fp8-static,...] [--rows 9,1] [--compiled] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from atomc.passes import PassManager  # noqa: E402
from models.loader import load_model  # noqa: E402
from tests.quant import fp8_checkpoints as fc  # noqa: E402

WRITERS = {
    "hf-fp8-static": ("base", lambda b, o: fc.write_hf_fp8(b, o, "static")),
    "hf-fp8-dynamic-transformers-names": ("base", lambda b, o: fc.write_hf_fp8(b, o, "dynamic", True)),
    "hf-fp8-block-128": ("wide", lambda b, o: fc.write_hf_fp8(b, o, "block")),
    "quark-ptpc": ("base", lambda b, o: fc.write_quark(b, o, "ptpc")),
}


def _record(model) -> tuple[list, list]:
    seen, hooks = [], []
    for name, mod in model.named_modules():
        if hasattr(mod, "linear_method"):
            hooks.append(mod.register_forward_hook(lambda m, a, out, name=name: seen.append((name, m, a[0], out))))
    return seen, hooks


def probe(qdir: Path, rows: int) -> dict:
    cpu = load_model(qdir, torch.float32, "cpu")
    gpu = load_model(qdir, torch.float32, "cuda")
    ids = torch.randint(0, 300, (rows,), generator=torch.Generator().manual_seed(rows))
    pos = torch.arange(rows)
    seen_c, hc = _record(cpu)
    seen_g, hg = _record(gpu)
    with torch.no_grad():
        want = cpu.compute_logits(cpu(ids, pos))
        got = gpu.compute_logits(gpu(ids.cuda(), pos.cuda())).cpu()
        for h in hc + hg:  # the local reruns below must not be recorded
            h.remove()
        layers = []
        for (name, mod_c, _, out_c), (_, _, x_g, out_g) in zip(seen_c, seen_g, strict=True):
            scale = out_c.abs().max().item() or 1.0
            local = mod_c(x_g.cpu())
            local = local[0] if isinstance(local, tuple) else local
            out_c = out_c[0] if isinstance(out_c, tuple) else out_c
            out_g = out_g[0] if isinstance(out_g, tuple) else out_g
            layers.append({
                "linear": name,
                "carried": ((out_g.cpu() - out_c).abs().max() / scale).item(),
                "local": ((out_g.cpu() - local).abs().max() / scale).item(),
            })  # fmt: skip
    diff = (got - want).abs()
    return {"rows": rows, "logits_max_abs": diff.max().item(), "logits_over_0.02": int((diff > 0.02).sum()),
            "logits_numel": diff.numel(), "layers": layers}  # fmt: skip


COMPILED_VARIANTS = ("", "fuse_rmsnorm_fp8_quant", "fuse_silu_mul_fp8_quant", "share_fp8_quant", "fuse_add_rmsnorm",
                     "decode_gemv")  # fmt: skip


def probe_compiled(qdir: Path, rows: int) -> dict:
    """Logits of the compiled GPU model against the CPU reference, per disabled pass ("": none)."""
    cpu = load_model(qdir, torch.float32, "cpu")
    gpu = load_model(qdir, torch.float32, "cuda")
    ids = torch.randint(0, 300, (rows,), generator=torch.Generator().manual_seed(rows))
    pos = torch.arange(rows)
    out = {}
    with torch.no_grad():
        want = cpu.compute_logits(cpu(ids, pos))
        for off in COMPILED_VARIANTS:
            torch._dynamo.reset()
            pm = PassManager.for_platform("cuda", disabled=[off] if off else [])

            def backend(gm, example_inputs, pm=pm):
                pm.run(gm)
                return gm

            fn = torch.compile(gpu.forward, backend=backend, fullgraph=True, dynamic=True)
            diff = (gpu.compute_logits(fn(ids.cuda(), pos.cuda())).cpu() - want).abs()
            out[off or "all passes"] = {"max_abs": diff.max().item(), "over_0.02": int((diff > 0.02).sum())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default=",".join(WRITERS))
    ap.add_argument("--rows", default="9,1")
    ap.add_argument("--compiled", action="store_true", help="also the compiled pipeline, pass by pass")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_pipeline_probe needs CUDA")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bases = {"base": fc.base_checkpoint(root / "base"), "wide": fc.base_checkpoint(root / "wide", wide=True)}
        for fmt in args.formats.split(","):
            base, write = WRITERS[fmt]
            qdir = write(bases[base], Path(tmp) / fmt)
            results[fmt] = [probe(qdir, int(r)) for r in args.rows.split(",")]
            for r in results[fmt]:
                print(f"{fmt} rows {r['rows']}: logits max |diff| {r['logits_max_abs']:.4f}, "
                      f"{r['logits_over_0.02']} of {r['logits_numel']} over 0.02")  # fmt: skip
                for layer in r["layers"]:
                    print(f"    {layer['linear']:<36} carried {layer['carried']:.2e}  local {layer['local']:.2e}")
            if args.compiled:
                for rows in (int(r) for r in args.rows.split(",")):
                    got = probe_compiled(qdir, rows)
                    results[f"{fmt} compiled rows {rows}"] = got
                    for off, d in got.items():
                        what = off if off == "all passes" else f"without {off}"
                        print(f"{fmt} compiled rows {rows}, {what}: max |diff| {d['max_abs']:.4f}, "
                              f"{d['over_0.02']} over 0.02")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
