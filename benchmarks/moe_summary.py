"""The summary table of a MoE suite run (`moe_suite.sh`): every decode_bs1_*.json and serving_*.json
under a folder, one row per engine or serving cell, as Markdown to paste into docs/performance.md.

    python benchmarks/moe_summary.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def decode_rows(res: dict) -> list[str]:
    rows = []
    for e in res.get("engines", []):
        if "error" in e:
            last = e["error"].strip().splitlines()[-1:] or ["?"]
            rows.append(f"| {res['model']} | batch 1 | {e['engine']} | ERROR: {last[0][:120]} | | |")
            continue
        kind = "decode" if "decode_tok_s" in e else "end to end"
        rate = e.get("decode_tok_s", e["e2e_tok_s"])
        rows.append(
            f"| {res['model']} | batch 1, {kind} | {e['engine']} | {rate:,.1f} | "
            f"{e['roofline_pct']:.1f}% of {res['roofline_tok_s']:,.0f} | start-up {e['startup_s']:.0f} s |"
        )
    return rows


def serving_rows(res: dict) -> list[str]:
    rows = []
    if "atomc_error" in res:
        last = res["atomc_error"].strip().splitlines()[-1:] or ["?"]
        rows.append(f"| {res['model']} | serving | atomc | ERROR: {last[0][-160:]} | | |")
    for r in res.get("atomc", []):
        experts = r.get("distinct_experts_per_layer")
        extra = f"D = {experts:.1f} of {r['experts']} experts; " if experts is not None else ""
        kv = r.get("kv_bytes_per_token")
        extra += f"KV {kv / 1e3:.1f} kB a token; " if kv else ""
        tpot, ttft = r.get("median_tpot_ms"), r.get("median_ttft_ms")
        extra += f"TPOT p50 {tpot:.2f} ms, TTFT p50 {ttft:,.0f} ms; " if tpot is not None and ttft is not None else ""
        rows.append(
            f"| {res['model']} | {res['isl']}/{res['osl']} CONC {r['conc']} | atomc | {r['output_throughput']:,.0f} | "
            f"{r['ceiling_pct']:.0f}% of {r['ceiling_tok_s']:,.0f} | "
            f"{extra}completed {r['completed']}/{r['num_prompts']} |"
        )
    hf = res.get("hf")
    if hf:
        if "error" in hf:
            rows.append(f"| {res['model']} | serving | transformers | ERROR: {hf['error'][-120:]} | | |")
        else:
            rows.append(
                f"| {res['model']} | {res['isl']}/{hf['output_len']} CONC {hf['conc']} | {hf['engine']} | "
                f"{hf['output_throughput']:,.1f} | | {hf['output_tokens']} tokens in {hf['duration']:.1f} s |"
            )
    return rows


def summary(folder: Path) -> str:
    lines = ["| model | load | engine | tok/s | of the ceiling | notes |", "|---|---|---|---|---|---|"]
    for path in sorted(folder.rglob("*.json")):
        res = json.loads(path.read_text())
        if path.name.startswith("decode_bs1"):
            lines += decode_rows(res)
        elif path.name.startswith("serving"):
            lines += serving_rows(res)
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1])))
