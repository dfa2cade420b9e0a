"""The quantisation suite's results (benchmarks/quant_suite.sh) as one short markdown report: the GPU
tests' counts and failures (junit XML), the FP8 linears' target figures, batch-1 decode of bf16
against FP8 (and gpt-fast int8 where it ran), the MXFP4 MoE kernel against bf16. A missing or
broken file is a line saying so, never an exception: the report must come out of a cut-short run.

    python benchmarks/quant_summary.py OUT
    python benchmarks/quant_summary.py OUT --serving     # benchmarks/fp8_serving.sh's variants only
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"{path.name}: not there or not JSON ({type(exc).__name__})"


def tests_section(out: Path) -> list[str]:
    xml = out / "gpu_tests.xml"
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError) as exc:
        return [f"- GPU tests: no junit XML ({type(exc).__name__}); see gpu_tests.log"]
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    lines = [
        f"- GPU tests: {passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped "
        f"of {n['tests']} in {float(suite.get('time', 0)):.0f} s"
    ]
    for case in suite.iter("testcase"):
        for kind in ("failure", "error"):
            bad = case.find(kind)
            if bad is not None:
                msg = (bad.get("message") or "").splitlines()[0][:160] if bad.get("message") else ""
                lines.append(f"  - {kind.upper()} {case.get('classname')}::{case.get('name')}: {msg}")
    return lines


def linear_section(out: Path) -> list[str]:
    data = _load(out / "fp8_linear.json")
    if isinstance(data, str):
        return [f"- fp8_linear: {data}"]
    rows = data.get("rows", [])
    bad = [r for r in rows if "error" in r or r.get("ok") is False]
    lines = [f"- fp8_linear: {len(rows)} rows, {len(bad)} failed"]
    for r in bad[:8]:
        lines.append(f"  - {r['shape']} M={r['m']} {r['impl']}: {r.get('error') or 'rel err ' + str(r.get('rel_err'))}")
    targets = data.get("targets", {})
    for name, t in targets.get("bs1_gemv", {}).items():
        lines.append(f"  - M=1 {name}: {t['speedup_vs_bf16']:.2f}x bf16, {t['pct_hbm']}% of HBM")
    for name, t in targets.get("dsv3_block_gemm", {}).items():
        route = f" ({t['route']})" if "route" in t else ""
        both = [f"{label} {t[f'{key}_pct_fp8_peak']}%" for label, key in (("Triton", "triton"), ("cuBLAS", "cublas"))
                if f"{key}_pct_fp8_peak" in t]  # fmt: skip
        both_text = f"; {', '.join(both)}" if both else ""
        if "pct_fp8_peak" not in t:
            lines.append(f"  - block GEMM {name}{route}: no time for the engine's route{both_text}")
            continue
        vs = f", {t['time_vs_scaled_mm']:.2f}x the time of _scaled_mm tensorwise" if "time_vs_scaled_mm" in t else ""
        ok = "meets" if t["meets_70pct"] else "below"
        lines.append(f"  - block GEMM {name}{route}: {t['pct_fp8_peak']}% of the FP8 peak ({ok} 70%){vs}{both_text}")
    return lines


def decode_section(out: Path) -> list[str]:
    lines = []
    for path in sorted(out.glob("decode_bs1_*.json")):
        data = _load(path)
        if isinstance(data, str):
            lines.append(f"- decode: {data}")
            continue
        for r in data.get("engines", []):
            if "error" in r:
                tail = [ln for ln in r["error"].strip().splitlines() if ln.strip()][-1:] or [""]
                lines.append(f"- decode {r['engine']}: ERROR {tail[0][:200]}")
            elif "skipped" in r:
                lines.append(f"- decode {r['engine']}: {r['skipped']}")
            else:
                rate = r.get("decode_tok_s", r["e2e_tok_s"])
                kind = "decode" if "decode_tok_s" in r else "e2e"
                lines.append(
                    f"- decode {r['engine']}: {rate:.1f} tok/s {kind}, {r['roofline_pct']:.1f}% of its "
                    f"{r['weights']} roofline ({r['roofline_tok_s']:.0f}), startup {r['startup_s']:.0f} s"
                )
        for name, ratio in data.get("speedups", {}).items():
            lines.append(f"  - {name}: {ratio:.2f}x")
    return lines or ["- decode: no decode_bs1_*.json"]


def moe_section(out: Path) -> list[str]:
    data = _load(out / "moe_kernel_mxfp4_gpt_oss.json")
    if isinstance(data, str):
        return [f"- moe_kernel: {data}"]
    rows = data.get("rows", [])
    fmt = data.get("meta", {}).get("weights", "mxfp4")
    us = {(r["tokens"], r["impl"]): r for r in rows}
    lines = []
    for (t, impl), r in sorted(us.items()):
        if impl != f"atomc_triton_{fmt}":
            continue
        if "error" in r:
            lines.append(f"- moe {fmt} M={t}: ERROR {r['error']}")
            continue
        base = us.get((t, "atomc_triton"), {})
        vs = f", {base['us'] / r['us']:.2f}x atomc bf16" if "us" in base else ""
        flag = "" if r.get("ok", True) else " CHECK FAILED"
        lines.append(
            f"- moe {fmt} M={t}: {r['us']} us, {r['pct_peak_bw']}% of HBM{vs}, rel err {r['rel_err']:.1e} "
            f"({r.get('route', '')}){flag}"
        )
    return lines or ["- moe_kernel: no quantised rows"]


SERVING_TARGETS = (  # (variant, against, CONC, target ratio of output throughput): issue 16
    ("fp8", "bf16", 64, 1.4),
    ("fp8kv", "fp8", 128, 1.15),
    ("fp8kv", "bf16", 64, 1.4),  # the CONC-64 target again, with the KV cache in FP8 too
)


def serving_section(out: Path) -> list[str]:
    """The variants of fp8_serving.sh (OUT/<variant>/serving.json): each cell, then the target ratios."""
    cells: dict[tuple[str, int], dict] = {}
    lines = []
    for variant in ("bf16", "fp8", "fp8kv"):
        data = _load(out / variant / "serving.json")
        if isinstance(data, str):
            lines.append(f"- serving {variant}: {data}")
            continue
        if "atomc_error" in data:
            lines.append(f"- serving {variant}: server failed: {data['atomc_error'][-200:]}")
        for r in data.get("atomc", []):
            cells[variant, r["conc"]] = r
            lines.append(
                f"- serving {variant} CONC {r['conc']}: {r['output_throughput']:.0f} tok/s, TPOT p50 "
                f"{r['median_tpot_ms']:.2f} ms, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
                f"completed {r['completed']}/{r['num_prompts']}"
            )
    for variant, base, conc, target in SERVING_TARGETS:
        a, b = cells.get((variant, conc)), cells.get((base, conc))
        if a is None or b is None:
            lines.append(f"- {variant} / {base} at CONC {conc}: not measured")
            continue
        ratio = a["output_throughput"] / b["output_throughput"]
        verdict = "meets" if ratio >= target else "below"
        lines.append(f"- {variant} / {base} at CONC {conc}: {ratio:.2f}x ({verdict} the {target}x target)")
    return lines


def summary(out: Path) -> str:
    return "\n".join([*tests_section(out), *linear_section(out), *decode_section(out), *moe_section(out)])


if __name__ == "__main__":
    if "--serving" in sys.argv[2:]:
        print("\n".join(serving_section(Path(sys.argv[1]))))
    else:
        print(summary(Path(sys.argv[1])))
