"""The compile report: per-pass matches/rewrites, partitions, FLOP shares (FP8 too), MoE nodes, timings.

FLOPs are per token (the token dim is symbolic: shapes are evaluated at T=1): GEMMs 2*M*N*K,
attention 4*ctx*Hq*D at a reference context of REF_CONTEXT tokens, a MoE block its active experts
only (2*(k+S)*(2I*H + H*I): each token runs k of the E experts and the S shared ones the op holds),
other ops one per output element.
"In atomc kernels" means inside an op of an atomc backend namespace (atomc::, atomc_triton::,
atomc_aiter::), whoever put it there; "rewritten" is the part whose op the passes introduced (not
in the graph as traced: the model's own attention and MoE calls count as atomc, not as rewritten).
"""

from __future__ import annotations

import json

import torch

from atomc.kernels.registry import NAMESPACES

_MATMULS = {"linear", "mm", "addmm", "matmul", "bmm"}
# atomc's FP8 GEMMs (models/quant/fp8.py): args (xq [..., K], x_scale, weight [N, K], ...)
# FP8 linears: x is args[0] ([..., K]; fp8_linear_dynamic's may be [..., 2K] before SiLU·mul), the
# e4m3 weight [N, K] args[2]
_FP8_GEMMS = {"fp8_gemm", "fp8_block_gemm", "fp8_gemm_shuffled", "fp8_block_gemm_shuffled", "fp8_linear_dynamic"}
REF_CONTEXT = 1024


def _num(x) -> int:
    """Concrete value of a (possibly symbolic) size at one token."""
    if isinstance(x, int):
        return x
    expr = x.node.expr
    return int(expr.subs({s: 1 for s in expr.free_symbols}))


def _shape(node) -> list[int] | None:
    val = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
    if isinstance(val, torch.Tensor):
        return [_num(s) for s in val.shape]
    return None


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name
    return getattr(t, "__name__", str(t))


def _numel(shape: list[int] | None) -> int:
    n = 1
    for d in shape or [0]:
        n *= d
    return n


def _arg(node: torch.fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def moe_node(node: torch.fx.Node) -> dict | None:
    """A MoE block's sizes from its node (atomc::moe's schema: x, router_logits, w13, w2, ..., top_k;
    atomc::moe_quant's: x, router_logits, w13, w13_scale, w2, w2_scale, ..., top_k, weight_format)."""
    op = _target_name(node).split("::")[-1]
    if op not in ("moe", "moe_quant"):
        return None
    if op == "moe":
        w13, w2, top_k = _shape(_arg(node, 2, "w13")), _shape(_arg(node, 3, "w2")), _arg(node, 8, "top_k")
        fmt = None
    else:
        w13, w2, top_k = _shape(_arg(node, 2, "w13")), _shape(_arg(node, 4, "w2")), _arg(node, 10, "top_k")
        fmt = _arg(node, 11, "weight_format")
        if fmt in ("mxfp4", "mxfp4_shuffled") and w13 and w2:  # two values a byte along the input dim
            w13, w2 = [*w13[:2], w13[2] * 2], [*w2[:2], w2[2] * 2]  # (AITER's layout: padded to 256)
    tokens = (_shape(_arg(node, 0, "x")) or [1])[0]
    shared = _arg(node, 17 if op == "moe" else 20, "num_shared_experts") or 0  # rows after the routed ones
    if not (w13 and w2 and isinstance(top_k, int) and isinstance(shared, int)):
        return None
    return {
        "node": node.name,
        "op": _target_name(node),
        "experts": w13[0] - shared,
        "top_k": top_k,
        "hidden": w13[2],
        "intermediate": w13[1] // 2,
        "flops_per_token": 2 * tokens * (top_k + shared) * (w13[1] * w13[2] + w2[1] * w2[2]),
        **({"weight_format": fmt} if fmt else {}),
        **({"shared_experts": shared} if shared else {}),
    }


def _is_atomc(name: str) -> bool:
    return name.split("::")[0] in NAMESPACES.values()


def _node_flops(node: torch.fx.Node) -> int:
    full = _target_name(node)
    name = full.split("::")[-1]
    if name in ("moe", "moe_quant") and _is_atomc(full):
        moe = moe_node(node)
        return moe["flops_per_token"] if moe else 0
    if name in _FP8_GEMMS and _is_atomc(full):
        x, w = _shape(node.args[0]), _shape(node.args[2])
        return 2 * _numel(x[:-1]) * w[0] * w[1] if x and w and len(w) == 2 else 0
    shapes = [_shape(a) for a in node.args if isinstance(a, torch.fx.Node)]
    if name in _MATMULS and len(shapes) >= 2 and shapes[0] and shapes[1] and len(shapes[1]) == 2:
        a, w = (shapes[1], shapes[2]) if name == "addmm" and len(shapes) > 2 and shapes[2] else (shapes[0], shapes[1])
        return 2 * _numel(a[:-1]) * w[0] * w[1]
    if "attention" in name and shapes and shapes[0] and len(shapes[0]) == 3:
        t, hq, d = shapes[0]
        return 4 * t * hq * d * REF_CONTEXT
    weights = [
        _shape(a)
        for a in node.args
        if isinstance(a, torch.fx.Node) and a.op in ("placeholder", "get_attr") and "weight" in a.name
    ]
    gemm = sum(2 * _numel(w) for w in weights if w and len(w) == 2)  # a fused op holding a linear
    val = node.meta.get("example_value", node.meta.get("val"))
    outs = val if isinstance(val, (tuple, list)) else [val]
    elementwise = sum(_numel([_num(d) for d in o.shape]) for o in outs if isinstance(o, torch.Tensor))
    return gemm + elementwise


def graph_flops(gm: torch.fx.GraphModule, baseline: dict | None = None) -> dict:
    """Per-token FLOPs: total, the part inside atomc kernels, the part inside atomc ops a pass
    introduced (an op not in `baseline`, the graph as traced), the MoE nodes, and the share of the
    linear layers' FLOPs (dense GEMMs and FP8 GEMMs) that runs in FP8 GEMMs."""
    total, atomc, rewritten, by_op, moe = 0, 0, 0, {}, []
    linear, fp8 = 0, 0
    before = {n.split("::")[-1] for n in (baseline or {}).get("atomc_ops", [])}
    ops = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = _target_name(node)
        try:
            f = _node_flops(node)
            info = moe_node(node) if _is_atomc(name) else None
        except Exception:  # a shape we cannot evaluate: leave it out rather than fail the compile
            f, info = 0, None
        total += f
        short = name.split("::")[-1]
        if short in _MATMULS or (short in _FP8_GEMMS and _is_atomc(name)):
            linear += f
            fp8 += f if short in _FP8_GEMMS else 0
        if _is_atomc(name):
            ops.add(name)
            atomc += f
            if name.split("::")[-1] not in before:
                rewritten += f
        if info:
            moe.append(info)
        if f:
            by_op[name] = by_op.get(name, 0) + f
    ref = (baseline or {}).get("total") or total
    return {
        "total_per_token": total,
        "reference_context": REF_CONTEXT,
        "atomc_per_token": atomc,
        "atomc_share": (atomc / ref) if ref else 0.0,
        "rewritten_per_token": rewritten,
        "rewritten_share": (rewritten / ref) if ref else 0.0,
        "atomc_ops": sorted(ops),
        "moe_nodes": moe,
        "linear_per_token": linear,
        "fp8_linear_share": (fp8 / linear) if linear else 0.0,
        "by_op": by_op,
    }


def format_report(manifest: dict) -> str:
    """Human-readable compile report from a manifest."""
    lines = [f"key        {manifest['key']}", f"format     {manifest['format']}"]
    lines.append("passes     name                      matched  rewritten  seconds")
    for p in manifest.get("passes", []):
        notes = f"  {p['notes']}" if p.get("notes") else ""  # what a pass declined, where lowering sent each op
        lines.append(f"           {p['name']:<25} {p['matched']:>7}  {p['rewritten']:>9}  {p['seconds']:>7.3f}{notes}")
    if not manifest.get("passes"):
        lines.append("           (none)")
    plan = manifest.get("partitions", [])
    graphs = sum(1 for p in plan if p["kind"] == "graph")
    splits = sorted({p["op"] for p in plan if p["kind"] == "split"})
    lines.append(f"partitions {graphs} graph pieces, {len(plan) - graphs} splits at {', '.join(splits) or '-'}")
    flops = manifest.get("flops", {})
    lines.append(
        f"flops      {flops.get('atomc_share', 0.0):.1%} of per-token FLOPs in atomc kernels, "
        f"{flops.get('rewritten_share', 0.0):.1%} in kernels the passes rewrote "
        f"(attention at a {flops.get('reference_context', REF_CONTEXT)}-token context, MoE at its active experts)"
    )
    if flops.get("fp8_linear_share"):
        lines.append(f"fp8        {flops['fp8_linear_share']:.1%} of the linear layers' FLOPs in FP8 GEMMs")
    moe = flops.get("moe_nodes", [])
    if moe:
        share = sum(m["flops_per_token"] for m in moe) / (flops.get("total_per_token") or 1)
        lines.append(f"moe        {len(moe)} nodes, {share:.1%} of per-token FLOPs")
        for m in moe:
            lines.append(
                f"           {m['node']:<12} {m['op']:<20} {m['experts']} experts, top-{m['top_k']}, "
                f"hidden {m['hidden']}, intermediate {m['intermediate']}"
                + (f", {m['shared_experts']} shared experts inside" if m.get("shared_experts") else "")
                + (f", {m['weight_format']} experts" if m.get("weight_format") else "")
            )
    t = manifest.get("timings", {})
    lines.append("timings    " + "  ".join(f"{k.removesuffix('_s')} {v:.2f}s" for k, v in t.items()))
    lines.append(f"artifact   {human_bytes(manifest.get('artifact_bytes', 0))}")
    return "\n".join(lines)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def to_json(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
