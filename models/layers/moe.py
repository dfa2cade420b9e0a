"""Mixture-of-experts layers: FusedMoE (every expert's weights stacked, one atomc::moe call) and the
sparse block a decoder layer uses (router + experts).

FusedMoE holds, for this rank's experts and this rank's slice of the intermediate size I:
- `w13_weight` [E_local, 2*I_local, H]: each expert's gate rows, then its up rows;
- `w2_weight` [E_local, H, I_local];
- optional `w13_bias` [E_local, 2*I_local], `w2_bias` [E_local, H];
- `expert_map` [E] int32 (global expert id -> local row, -1 for experts another rank holds), or None
  when this rank holds every expert (expert-parallel size 1: the op then skips the lookup).

Sharding is a pure function of two (rank, size) pairs: `tp` splits I (rank r holds gate rows,
up rows and w2 columns r*I/size ...: the SwiGLU stays local, the output is a partial sum), `ep`
splits the experts into contiguous ranges (rank r holds experts r*E/size ...). Either way the
ranks' outputs sum to the whole block's: `partial_forward` is one rank's share; `forward` needs
the sum, which the collective of the TP/EP issue brings, so it refuses sizes > 1 until then.

Quantised experts: `set_moe_method` (the loader calls it on the meta model for a quantised
checkpoint) swaps w13_weight / w2_weight for the method's parameters (models/quant/mxfp4.py,
models/quant/fp8_moe.py) and forward then runs the method's op (atomc::moe_quant). Tags on a
parameter say how the loader slices it: `k_pack` (values per element along the input dim) cuts
w2's TP slice of I in those units, `n_pack` (rows per element) w13's gate and up rows (a 128x128
block scale: one element per 128 rows), `has_input_dim` False marks w2's per-row scales [E, H]
(nothing to slice). Checkpoint leaves other than weight / bias (`weight_scale`, `input_scale`)
map to `w13_<leaf>` / `w2_<leaf>`.

Every parameter carries `weight_loader(param, tensor, shard_id)`. A per-expert checkpoint tensor
comes with shard id (expert, "gate" | "up" | "down"); a fused tensor holding every expert
([E, 2I, H], [E, H, I], ...) with shard id None. Tensors of experts on other ranks are skipped.
`ExpertNames` says how a family's checkpoint spells its expert tensors (the loader maps them).

Shared experts (`MoESpec.shared_experts` S > 0, DeepSeek's when fused: models/deepseek.py) are S
more rows after the routed experts: the checkpoint's shared MLP (intermediate S*I) loads with shard
id ("shared", part) and is cut into S experts of I (an MLP is a sum over its intermediate units);
the op gives every token those S slots too. Not under expert parallelism (every rank would need them).

Routing happens inside the op (models/layers and kernels agree on one contract: atomc/ops/moe.py);
the router itself is a ReplicatedLinear outside it, so its GEMM is an ordinary linear in the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

import atomc.ops  # noqa: F401  (registers torch.ops.atomc.moe)
from atomc.ops.moe import check_moe_args
from models.layers.linear import ReplicatedLinear
from models.layers.parallel import SINGLE, ParallelInfo, all_reduce
from models.quant.base import set_weight_attrs

GATE_UP = ("gate", "up")
PARTS = ("gate", "up", "down")


@dataclass(frozen=True)
class MoESpec:
    """A family's MoE block: sizes and routing (the atomc::moe arguments), checked when parsed."""

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str = "softmax"
    renormalize: bool = True
    activation: str = "silu"
    expert_bias: bool = False  # w13_bias / w2_bias (GPT-OSS)
    router_bias: bool = False
    num_expert_group: int = 0
    topk_group: int = 0
    routed_scaling_factor: float = 1.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_experts: int = 0  # shared experts of intermediate_size run inside the op (module docstring)

    def routing_args(self) -> tuple:
        """The routing and activation arguments atomc::moe and atomc::moe_quant take after top_k
        (and moe_quant's weight format), in their order."""
        return (
            self.scoring, self.renormalize, self.num_expert_group, self.topk_group, self.routed_scaling_factor,
            self.activation, self.swiglu_alpha, self.swiglu_limit, self.shared_experts,
        )  # fmt: skip

    def __post_init__(self):
        check_moe_args(self.scoring, self.activation, self.top_k, self.num_experts)
        if self.num_expert_group and self.num_experts % self.num_expert_group:
            raise ValueError(f"{self.num_experts} experts do not split into {self.num_expert_group} groups")


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names expert tensors under the FusedMoE module called `container`.

    `per_expert`: checkpoint module -> part, for `<container>.<expert>.<module>.weight|bias`
    (Qwen3-MoE: gate_proj/up_proj/down_proj; Mixtral: w1/w3/w2). `fused`: tensor name -> FusedMoE
    parameter, for `<container>.<name>` holding every expert (transformers' in-memory layout).
    `shared`: `<shared>.<module>.<leaf>` beside the container (DeepSeek's `shared_experts`) loads into
    the container's parameters with shard id ("shared", part)."""

    per_expert: dict[str, str]
    shared: str | None = None  # the shared MLP's module beside `container`, when the FusedMoE holds it
    fused: dict[str, str] = field(
        default_factory=lambda: {
            "gate_up_proj": "w13_weight",
            "down_proj": "w2_weight",
            "gate_up_proj_bias": "w13_bias",
            "down_proj_bias": "w2_bias",
        }
    )
    container: str = "experts"

    def __post_init__(self):
        if sorted(self.per_expert.values()) != sorted(PARTS):
            raise ValueError(f"per_expert must name each of {PARTS} once, got {self.per_expert}")

    def to_param(self, parts: list[str]) -> tuple[str, object] | None:
        """Dotted checkpoint name (split) -> (FusedMoE parameter name, shard id), None if no expert tensor."""
        for i, p in enumerate(parts):
            if p == self.shared and self.shared is not None:
                rest = parts[i + 1 :]
                if len(rest) == 2 and rest[0] in self.per_expert and rest[1].isidentifier():
                    part = self.per_expert[rest[0]]
                    param = f"{'w2' if part == 'down' else 'w13'}_{rest[1]}"
                    return ".".join([*parts[:i], self.container, param]), ("shared", part)
            if p != self.container:
                continue
            rest = parts[i + 1 :]
            # a leaf is the weight, the bias, or a quantised checkpoint's scale (weight_scale, input_scale ...)
            if len(rest) == 3 and rest[0].isdigit() and rest[1] in self.per_expert and rest[2].isidentifier():
                part = self.per_expert[rest[1]]
                param = f"{'w2' if part == 'down' else 'w13'}_{rest[2]}"
                return ".".join([*parts[: i + 1], param]), (int(rest[0]), part)
            if len(rest) == 1 and rest[0] in self.fused:
                return ".".join([*parts[: i + 1], self.fused[rest[0]]]), None
        return None

    def to_checkpoint(self, param_name: str, shard_id, fused: bool = False) -> str:
        """The inverse: which checkpoint tensor fills this shard (or, `fused`, all) of a FusedMoE parameter."""
        prefix, _, leaf = param_name.rpartition(".")
        shared = shard_id is not None and shard_id[0] == "shared"
        if (fused or shard_id is None) and not shared:
            return f"{prefix}.{next((k for k, v in self.fused.items() if v == leaf), leaf)}"
        expert, part = shard_id
        module = next(k for k, v in self.per_expert.items() if v == part)
        if shared:  # the shared MLP's own tensor, whatever layout the routed experts come in
            return f"{prefix.removesuffix(self.container)}{self.shared}.{module}.{leaf.split('_', 1)[1]}"
        return f"{prefix}.{expert}.{module}.{leaf.split('_', 1)[1]}"


class FusedMoE(nn.Module):
    def __init__(self, hidden_size: int, spec: MoESpec, tp: ParallelInfo = SINGLE, ep: ParallelInfo = SINGLE):
        super().__init__()
        self.spec, self.tp, self.ep = spec, tp, ep
        self.hidden_size, self.num_experts = hidden_size, spec.num_experts
        if spec.num_experts % ep.size:
            raise ValueError(f"{spec.num_experts} experts do not divide across {ep.size} expert-parallel ranks")
        self.num_local_experts = spec.num_experts // ep.size
        self.num_shared = spec.shared_experts
        if self.num_shared and ep.size > 1:
            raise ValueError("shared experts run inside the MoE op only without expert parallelism")
        self.expert_rows = self.num_local_experts + self.num_shared  # routed rows, then the shared ones
        self.first_expert = ep.rank * self.num_local_experts
        self.intermediate_size = spec.intermediate_size
        self.local_intermediate = tp.split(spec.intermediate_size, "MoE intermediate size")
        e, i, h = self.expert_rows, self.local_intermediate, hidden_size
        self.params_dtype = dtype = torch.get_default_dtype()  # the model's: the block's activations
        shapes = {"w13_weight": (e, 2 * i, h), "w2_weight": (e, h, i)}
        if spec.expert_bias:
            shapes.update(w13_bias=(e, 2 * i), w2_bias=(e, h))
        for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
            if name not in shapes:
                self.register_parameter(name, None)
                continue
            p = nn.Parameter(torch.empty(shapes[name], dtype=dtype), requires_grad=False)
            attrs = {"weight_loader": self.weight_loader, "shard_ids": self.shard_ids_of(name), "moe_param": name}
            set_weight_attrs(p, attrs)
            self.register_parameter(name, p)
        self.register_buffer("expert_map", self._expert_map() if ep.size > 1 else None, persistent=False)
        self.moe_method = None  # None: dense experts, atomc::moe; else a quantised method (set_moe_method)

    def shard_ids_of(self, name: str) -> tuple:
        """Every (expert, part) shard a w13_* / w2_* parameter holds (for the loader's missing-tensor
        check): each routed expert's, then ("shared", part) when it holds the shared experts."""
        experts = [*range(self.num_experts), *(["shared"] if self.num_shared else [])]
        if name.startswith("w13"):
            return tuple((x, p) for x in experts for p in GATE_UP)
        return tuple((x, "down") for x in experts)

    def set_moe_method(self, method) -> None:
        """Store the experts as `method` says (models/quant/mxfp4.py): its parameters replace the dense
        w13_weight / w2_weight; the biases stay. Called on the meta model, before loading. The new
        parameters get the dense weights' loader, which a family reading its own layout (GPT-OSS)
        may have replaced (no loader is kept on the module itself: the compiled artifact pickles
        what the forward's guards touch, and a loader must not be part of it)."""
        loader = self.w13_weight.weight_loader
        for name in ("w13_weight", "w2_weight"):
            delattr(self, name)
            self.register_parameter(name, None)
        method.create_weights(self, loader)
        self.moe_method = method

    def _expert_map(self, device=None) -> torch.Tensor:
        m = torch.full((self.num_experts,), -1, dtype=torch.int32, device=device)
        m[self.first_expert : self.first_expert + self.num_local_experts] = torch.arange(
            self.num_local_experts, dtype=torch.int32, device=device
        )
        return m

    def reset_buffers(self) -> None:
        """Called by the loader after moving the module off the meta device (buffers come back empty)."""
        if self.expert_map is not None:
            self.expert_map = self._expert_map(self.expert_map.device)

    def local_expert(self, expert: int) -> int | None:
        """This rank's row of a global expert id, None if another rank holds it."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range (the model has {self.num_experts} experts)")
        local = expert - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        name = param.moe_param
        if shard_id is None:  # every expert stacked on dim 0
            if loaded.dim() < 1 or loaded.shape[0] != self.num_experts:
                raise ValueError(
                    f"has shape {tuple(loaded.shape)}, but a fused {name} holds all {self.num_experts} experts on dim 0"
                )
            for x in range(self.first_expert, self.first_expert + self.num_local_experts):
                self._load_expert(param, name, loaded[x], x - self.first_expert, None)
            return
        expert, part = shard_id
        allowed = ("down",) if name.startswith("w2") else GATE_UP
        if part not in allowed:
            raise ValueError(f"shard {shard_id!r} does not belong in {name} (its parts: {', '.join(allowed)})")
        if expert == "shared":
            for j, chunk in enumerate(self.shared_chunks(param, loaded, part)):
                self._load_expert(param, name, chunk, self.num_local_experts + j, part)
            return
        local = self.local_expert(expert)
        if local is not None:  # another expert-parallel rank's tensor: not ours to hold
            self._load_expert(param, name, loaded, local, part)

    def shared_chunks(self, param, loaded: torch.Tensor, part: str) -> list[torch.Tensor]:
        """The shared MLP's tensor for `part` cut into its S experts' (along I: rows of gate / up,
        columns of down, in the parameter's packed units); a per-row scale of down ([H]: its rows
        are H, not I) is every chunk's, a down bias the first chunk's."""
        if not self.num_shared:
            raise ValueError("is a shared expert's tensor, but this MoE layer holds no shared experts")
        if part != "down":
            dim, pack = 0, getattr(param, "n_pack", 1)
        elif param.moe_param == "w2_bias":  # added once: by the first chunk
            return [loaded] + [torch.zeros_like(loaded)] * (self.num_shared - 1)
        elif getattr(param, "has_input_dim", True):
            dim, pack = 1, getattr(param, "k_pack", 1)
        else:
            return [loaded] * self.num_shared
        whole = self.num_shared * self.intermediate_size // pack
        _check(loaded, dim, whole, f" (the {self.num_shared} shared experts' {part})")
        return list(loaded.split(whole // self.num_shared, dim=dim))

    def _load_expert(self, param, name: str, src: torch.Tensor, local: int, part) -> None:
        """One expert's tensor (one part, or for w13 both gate and up when `part` is None) into row `local`."""
        dst = param.data[local]
        n, full = self.local_intermediate, self.intermediate_size
        shared = local - self.num_local_experts
        expert = local + self.first_expert if shared < 0 else f"shared {shared}"
        what = "" if part is None else f" (expert {expert} {part})"
        if name.startswith("w13"):  # rows of I (in scale blocks when `n_pack` rows share an element)
            rows = getattr(param, "n_pack", 1)
            n, full = n // rows, full // rows
            if part is None:
                _check(src, 0, 2 * full, what)
                for p, section in zip(GATE_UP, src.split(full, dim=0), strict=True):
                    self._load_expert(param, name, section, local, p)
                return
            _check(src, 0, full, what)
            dst = dst.narrow(0, 0 if part == "gate" else n, n)
            src = src.narrow(0, self.tp.rank * n, n)
        elif name != "w2_bias" and getattr(param, "has_input_dim", True):
            # [H, I]: this rank's columns of I (in bytes / scale groups when packed); not a per-row scale [H]
            pack = getattr(param, "k_pack", 1)
            _check(src, 1, full // pack, what)
            src = src.narrow(1, self.tp.rank * n // pack, n // pack)
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}{what}")
        dst.copy_(src)

    def checkpoint_shapes(self) -> dict[tuple[str, object], tuple[int, ...]]:
        """(parameter leaf, shard id) -> shape of each per-expert tensor a checkpoint holds (TP/EP size 1)."""
        h, i = self.hidden_size, self.intermediate_size
        out = {}
        for x in range(self.num_experts):
            for part in PARTS:
                w, b = ((h, i), (h,)) if part == "down" else ((i, h), (i,))
                prefix = "w2" if part == "down" else "w13"
                out[(f"{prefix}_weight", (x, part))] = w
                if self.spec.expert_bias:
                    out[(f"{prefix}_bias", (x, part))] = b
        s = self.num_shared * i
        if s:  # the shared MLP's three tensors
            out |= {("w13_weight", ("shared", p)): (s, h) for p in GATE_UP}
            out[("w2_weight", ("shared", "down"))] = (h, s)
        return out

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, correction_bias=None) -> torch.Tensor:
        # every rank routes all tokens (replicated router, TP attention), so the ranks' partial
        # blocks (their experts, or their slice of I) sum to the block: one all-reduce combines them
        partial = self.partial_forward(x, router_logits, correction_bias)
        return all_reduce(self.ep if self.ep.size > 1 else self.tp, partial)

    def partial_forward(self, x: torch.Tensor, router_logits: torch.Tensor, correction_bias=None) -> torch.Tensor:
        """This rank's share of the block: its experts, its slice of I (w2's bias on TP rank 0 only)."""
        if self.moe_method is not None:
            return self.moe_method.apply(self, x, router_logits, correction_bias)
        s = self.spec
        return torch.ops.atomc.moe(
            x,
            router_logits,
            self.w13_weight,
            self.w2_weight,
            self.w13_bias,
            self.w2_bias if self.tp.rank == 0 else None,
            self.expert_map,
            correction_bias,
            s.top_k,
            *s.routing_args(),
        )


def _check(t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if t.dim() <= dim or t.shape[dim] != expected:
        raise ValueError(f"has shape {tuple(t.shape)}, but its dim {dim} should be {expected}{what}")


def expert_sharding(parallel: ParallelInfo) -> tuple[ParallelInfo, ParallelInfo]:
    """(tp, ep) for a MoE layer on these ranks: experts split across them under expert parallelism
    (each expert whole on one rank), else every expert's intermediate size split."""
    return (SINGLE, parallel) if parallel.expert_parallel and parallel.size > 1 else (parallel, SINGLE)


class SparseMoEBlock(nn.Module):
    """A decoder layer's MLP when it is a mixture of experts: `gate` (the router, replicated on every
    rank) then `experts` (FusedMoE). The names are the checkpoints' (`mlp.gate.weight`, `mlp.experts.*`)."""

    def __init__(self, hidden_size: int, spec: MoESpec, tp: ParallelInfo = SINGLE, ep: ParallelInfo = SINGLE):
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, spec.num_experts, spec.router_bias, tp)
        self.experts = FusedMoE(hidden_size, spec, tp, ep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))
