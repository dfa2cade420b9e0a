"""Load a Hugging Face checkpoint directory (config.json + one or sharded *.safetensors).

1. Build the model on the meta device in the target dtype (no random init, no memory).
2. Map each checkpoint tensor's name through the family's naming (CheckpointNaming: layer prefixes,
   module renames, expert names, packed_modules_mapping) to (parameter, shard id) (`...q_proj.weight`
   -> `...qkv_proj.weight`, "q"; `...experts.3.up_proj.weight` -> `...experts.w13_weight`, (3, "up")).
3. Then one layer at a time (`layer_groups`: the modules outside numbered layers, then each
   `model.layers.N`, `mtp.N`, ...): materialise its parameters on the target device (keeping each
   parameter's attributes, its weight_loader and layout tags, and shared parameters such as tied
   embeddings shared), hand each of its tensors to the parameter's weight_loader (which writes
   this rank's slice into the right place), and call its linear / MoE methods'
   process_weights_after_loading. So a load never holds more than the processed layers plus one
   unprocessed layer: `--quantization fp8` of Mixtral-8x7B (93 GB in bf16, about 47 GB in FP8)
   needs its FP8 size and one bf16 layer, not its bf16 size.

FP8 KV-cache scales (`...self_attn.k_scale` and the other spellings, models/loader/kv_scales.py) are
no parameters: they are collected per layer into `model.kv_cache_scales` for the runner.

A quantised checkpoint (its config.json's quantization_config) or `--quantization fp8` picks each
linear's FP8 method on the meta model, before step 2 (models/loader/quantize.py).

Safetensors only: atomc never unpickles a checkpoint. Errors name the tensor and its file.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from atomc.progress import progress_bar
from models.arch import ModelArch
from models.layers.moe import ExpertNames, FusedMoE
from models.layers.parallel import SINGLE, ParallelInfo
from models.loader.kv_scales import kv_scale_target, record_kv_scale
from models.loader.quantize import apply_quantization
from models.quant.spec import resolve as resolve_quantization
from models.registry import build_model

_LOADED = "_atomc_loaded_shards"  # a parameter's shard ids written so far, while a load runs
# checkpoint keys that carry no weights atomc needs (recomputed buffers)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LOAD_FORMATS = ("safetensors", "dummy")


def checkpoint_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt*"))
        hint = f" (found {', '.join(found)}: atomc does not load pickled weights)" if found else ""
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights{hint}")
    return files


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: str | torch.device,
    load_format: str = "safetensors",
    parallel: ParallelInfo = SINGLE,
    mtp: bool = False,
    quantization: str | None = None,
) -> nn.Module:
    """load_format "dummy" fills random weights on the device instead of reading files (benchmarks).
    `mtp`: also build and load the checkpoint's multi-token-prediction layers (DeepSeek-V3/R1), for
    a speculative-decoding step; off, they are skipped and nothing is allocated for them.
    `quantization` is `--quantization` (None: as the checkpoint says)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format {load_format!r} is not one of: {', '.join(LOAD_FORMATS)}")
    arch = ModelArch.from_dir(model_dir)
    model = build_on_meta(arch, dtype, parallel, mtp=mtp, quantization=quantization)
    files = [] if load_format == "dummy" else checkpoint_files(model_dir)
    adapt = getattr(model, "adapt_to_checkpoint", None)  # a family whose modules depend on the tensors present
    if adapt is not None:
        adapt(tensor_names(files) if files else None)
    if load_format == "dummy":
        groups = layer_groups(model)
        shared = shared_parameters(groups)
        gen = None
        for group in groups:
            materialize(model, device, group, shared)
            gen = fill_dummy_weights(model, group=group, gen=gen)
            process_weights_after_loading(model, group)
    else:
        load_weights(model, files, device)
    return model.eval()


Group = dict[str, nn.Module]  # a loading group's modules by name, in model order


def layer_groups(model: nn.Module) -> list[Group]:
    """The model's modules in loading order: those outside numbered layers (embeddings, final norm,
    LM head) first, then one group a numbered layer (`model.layers.3`, `mtp.0`), in model order. A
    layer's modules are processed together, so it is the unit of peak memory."""
    groups: dict[str, Group] = {"": {}}
    for name, module in model.named_modules():
        parts = name.split(".") if name else []
        cut = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        key = "" if cut is None else ".".join(parts[: cut + 1])
        groups.setdefault(key, {})[name] = module
    return [group for group in groups.values() if group]


def _group_parameters(group: Group) -> dict[str, nn.Parameter]:
    """The parameters the group's modules hold themselves, by full name."""
    return {f"{m}.{n}" if m else n: p for m, module in group.items() for n, p in module.named_parameters(recurse=False)}


def shared_parameters(groups: list[Group]) -> dict[int, None]:
    """{id: None} for each (meta) parameter that modules of more than one group hold."""
    seen: dict[int, int] = {}
    shared: dict[int, None] = {}
    for g, group in enumerate(groups):
        for module in group.values():
            for p in module._parameters.values():
                if p is not None and seen.setdefault(id(p), g) != g:
                    shared[id(p)] = None
    return shared


def _group_of(groups: list[Group]):
    """param or module name -> index of its group in `groups`."""
    index = {name: i for i, names in enumerate(groups) for name in names}

    def find(param_name: str) -> int | None:
        return index.get(param_name.rpartition(".")[0])

    return find


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_on_meta(
    arch: ModelArch,
    dtype: torch.dtype,
    parallel: ParallelInfo = SINGLE,
    mtp: bool = False,
    quantization: str | None = None,
) -> nn.Module:
    """The model with meta parameters in `dtype` (layers create their weights in the default dtype),
    each linear with the method its quantisation asks for (the checkpoint's, or `quantization`)."""
    with _default_dtype(dtype), torch.device("meta"):
        model = build_model(arch, parallel, mtp=mtp)
        apply_quantization(model, resolve_quantization(arch.raw, quantization), CheckpointNaming.of(model))
        return model


def tensor_names(files: list[Path]) -> set[str]:
    """Every tensor name the checkpoint holds (reads the safetensors headers only)."""
    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def _modules(model: nn.Module, group: Group | None) -> list[nn.Module]:
    return list(model.modules()) if group is None else list(group.values())


def materialize(
    model: nn.Module, device: str | torch.device, group: Group | None = None, shared: dict | None = None
) -> None:
    """Replace meta parameters and buffers by uninitialised ones on `device`, once per tensor: every
    module's, or those of the modules in `group` (one of `layer_groups`). `shared` ({id of a meta
    parameter: None or the parameter made for it}, from `shared_parameters`) carries the parameters
    that modules of several groups hold (tied embeddings) from one group to the next, so they stay
    one tensor; no other parameter is referenced from here once the call returns (a layer's
    processing may then free its unquantised weights).

    Not `Module.to_empty`: that makes new Parameters without the attributes the loader relies on
    (weight_loader, output_dim, ...) and unties shared ones."""
    new = {}
    modules = _modules(model, group)
    for module in modules:
        for name, p in module._parameters.items():
            if p is None:
                continue
            made = new.get(id(p))
            if made is None and shared is not None:
                made = shared.get(id(p))
            if made is None and not p.is_meta:
                continue  # a real parameter already (a test's model)
            if made is None:
                made = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                made.__dict__.update(p.__dict__)
                new[id(p)] = made
                if shared is not None and id(p) in shared:
                    shared[id(p)] = made
            module._parameters[name] = made
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)
    for module in modules:
        if hasattr(module, "reset_buffers"):  # recomputed tables (RoPE cos/sin)
            module.reset_buffers()


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0, group: Group | None = None, gen=None):
    """Random weights, generated on the parameters' device (fast for an 8B shape on a GPU): every
    parameter, or those of the modules in `group` (then pass the generator each call returns on
    to the next, so the draws do not depend on the grouping)."""
    named = list(model.named_parameters() if group is None else _group_parameters(group).items())
    if not named:
        return gen
    if gen is None:
        gen = torch.Generator(device=named[0][1].device).manual_seed(seed)
    for name, p in named:
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(("_scale", "_scale_inv")):  # FP8 scales: fp8 values of about +-1 mean 0.02
            p.fill_(0.02)
        elif name.endswith("_scales") and p.dtype == torch.uint8:  # MXFP4 exponents: 2^-7, values up to 0.05
            p.fill_(120)
        elif name.endswith("_blocks") and p.dtype == torch.uint8:  # MXFP4 codes: any byte is two values
            p.copy_(torch.randint(0, 256, p.shape, device=p.device, generator=gen, dtype=torch.uint8))
        elif p.dtype == torch.float8_e4m3fn:
            # through fp32 a slice at a time: a whole temporary is 4x the weight (7 GiB for V3's experts)
            rows = p.view(p.shape[0], -1) if p.dim() else p.view(1)
            step = max(1, (1 << 26) // max(1, rows[0].numel()))
            for i in range(0, rows.shape[0], step):
                part = rows[i : i + step]
                part.copy_(torch.empty(part.shape, device=p.device).normal_(0.0, 1.0, generator=gen).to(p.dtype))
        elif p.is_floating_point():
            p.normal_(0.0, 0.02, generator=gen)
    return gen


def process_weights_after_loading(model: nn.Module, group: Group | None = None) -> None:
    for module in _modules(model, group):
        for attr in ("linear_method", "moe_method"):
            method = getattr(module, attr, None)
            if method is not None:
                method.process_weights_after_loading(module)


@dataclass(frozen=True)
class CheckpointNaming:
    """How a family's checkpoint names map to the model's parameters, and back.

    In order: `prefixes` ((checkpoint prefix, parameter prefix) pairs, the longest match wins:
    DeepSeek-V3's MTP layers `model.layers.{N}.` -> `mtp.0.block.`), then `renames` (checkpoint
    module -> ours, whole components: Mixtral's block_sparse_moe -> mlp), then `experts`
    (per-expert or fused expert tensors -> FusedMoE parameters and shard ids), then `packed`
    (q/k/v, gate/up -> merged layers). The way back names the hub's layout (renamed, per-expert),
    or with `hub=False` the model's own names with fused experts (what transformers holds in
    memory and writes with save_original_format=False)."""

    packed: dict[str, tuple[str, object]] = field(default_factory=dict)
    experts: ExpertNames | None = None
    renames: dict[str, str] = field(default_factory=dict)
    prefixes: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, model: nn.Module) -> CheckpointNaming:
        return cls(
            getattr(model, "packed_modules_mapping", {}),
            getattr(model, "expert_names", None),
            getattr(model, "checkpoint_renames", {}),
            tuple(getattr(model, "checkpoint_prefixes", ())),
        )

    def _swap_prefix(self, name: str, to_param: bool) -> str:
        pairs = [(a, b) if to_param else (b, a) for a, b in self.prefixes]
        hits = [(src, dst) for src, dst in pairs if name.startswith(src)]
        if not hits:
            return name
        src, dst = max(hits, key=lambda hit: len(hit[0]))
        return dst + name[len(src) :]

    def to_param(self, name: str) -> tuple[str, object]:
        """`model.layers.0.self_attn.k_proj.weight` -> (`model.layers.0.self_attn.qkv_proj.weight`, "k");
        `...mlp.experts.3.up_proj.weight` -> (`...mlp.experts.w13_weight`, (3, "up")).

        Matches whole dotted components, so `k_proj` never matches inside another name."""
        parts = [self.renames.get(p, p) for p in self._swap_prefix(name, to_param=True).split(".")]
        if self.experts is not None:
            hit = self.experts.to_param(parts)
            if hit is not None:
                return hit
        for i, part in enumerate(parts):
            if part in self.packed:
                packed, shard_id = self.packed[part]
                return ".".join([*parts[:i], packed, *parts[i + 1 :]]), shard_id
        return ".".join(parts), None

    def to_checkpoint(self, param_name: str, shard_id, hub: bool = True, moe: bool = False) -> str:
        """Which checkpoint tensor fills this shard of the parameter (`moe`: a FusedMoE parameter)."""
        if moe and self.experts is not None:
            name = self.experts.to_checkpoint(param_name, shard_id, fused=not hub)
        else:
            name = param_name
            for ckpt_part, (packed, sid) in self.packed.items():
                if sid == shard_id and f".{packed}." in f".{param_name}":
                    name = param_name.replace(f"{packed}.", f"{ckpt_part}.", 1)
                    break
        if hub and self.renames:
            back = {ours: theirs for theirs, ours in self.renames.items()}
            name = ".".join(back.get(p, p) for p in name.split("."))
        return self._swap_prefix(name, to_param=False)


def map_checkpoint_name(name: str, mapping: dict[str, tuple[str, object]], experts=None, renames=None):
    """(parameter name, shard id) of a checkpoint tensor (see CheckpointNaming.to_param)."""
    return CheckpointNaming(mapping, experts, renames or {}).to_param(name)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if shard_id is not None:
        raise ValueError(f"this parameter has no shards (got shard id {shard_id!r})")
    if loaded.shape != param.shape:
        raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


def load_weights(model: nn.Module, files: list[Path], device: str | torch.device | None = None) -> None:
    """Load `files` into the model, layer by layer (the module docstring, step 3). `device`: where
    the meta parameters are materialised; None: the model's parameters are real already (a test's
    model), then loaded and processed as they are."""
    naming = CheckpointNaming.of(model)
    groups = layer_groups(model)
    group_of = _group_of(groups)
    # a family's tensors the model does not hold by design (DeepSeek-V3's MTP layers), by name
    skips = getattr(model, "skips_checkpoint_tensor", None)
    aliases = getattr(model, "quant_tensor_aliases", {})
    meta_params = dict(model.named_parameters(remove_duplicate=False))  # tied heads appear under both names
    model.kv_cache_scales = {}  # layer -> {"k": scale, "v": scale}, as the checkpoint ships them
    # which tensors each group loads: (file, checkpoint name, parameter name, shard id)
    work: list[list[tuple]] = [[] for _ in groups]
    unexpected: list[str] = []
    with ExitStack() as stack:
        opened = {path: stack.enter_context(safe_open(str(path), framework="pt", device="cpu")) for path in files}
        for path, f in opened.items():
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (skips is not None and skips(name)):
                    continue
                kv_scale = kv_scale_target(name)
                if kv_scale is not None and _load_kv_scale(model, naming, kv_scale, name, f, path):
                    continue
                param_name, shard_id = naming.to_param(name)
                if param_name not in meta_params and aliases:  # a quantised checkpoint's other spelling of a scale
                    head, _, leaf = param_name.rpartition(".")
                    param_name = f"{head}.{aliases.get(leaf, leaf)}"
                g = group_of(param_name) if param_name in meta_params else None
                if g is None:
                    unexpected.append(name)
                    continue
                work[g].append((path, name, param_name, shard_id))
        shared = shared_parameters(groups)
        missing: list[str] = []
        fused_experts = False  # the checkpoint stacks experts (then missing names are given that way too)
        bar = progress_bar(len(groups), "weights", "layer")
        for group, tensors in zip(groups, work, strict=True):
            bar.update(1)
            if device is not None:
                materialize(model, device, group, shared)
            params = _group_parameters(group)
            for path, name, param_name, shard_id in tensors:
                param = params[param_name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    loader(param, opened[path].get_tensor(name), shard_id)
                except ValueError as e:
                    raise ValueError(f"{path.name}: {name} {e}") from None
                # on the parameter itself: one tied to a later group's (MTP's head) counts there too
                param.__dict__.setdefault(_LOADED, set()).add(shard_id)
                fused_experts |= shard_id is None and hasattr(param, "moe_param")
            done = {id(p): p.__dict__.get(_LOADED, set()) for p in params.values()}
            gaps = _missing(model, params, done, naming, hub=not fused_experts)
            params = done = param = None  # nothing here may keep the layer's unquantised weights alive
            if gaps:  # the load fails below, naming every gap; processing would read uninitialised memory
                missing += gaps
            else:
                process_weights_after_loading(model, group)
        bar.close()
    for p in model.parameters():
        p.__dict__.pop(_LOADED, None)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
        raise ValueError("checkpoint does not match the model's parameters; " + "; ".join(parts))


def _load_kv_scale(model, naming, target: tuple[list[str], str], name: str, f, path: Path) -> bool:
    """Record a checkpoint KV-cache scale (models/loader/kv_scales.py) on the layer its name's prefix
    maps to (the family's naming of a leaf under it); False when no attention layer matches."""
    prefixes, which = target
    for attn in prefixes:
        prefix = naming.to_param(f"{attn}.weight")[0].removesuffix(".weight")
        try:
            if record_kv_scale(model, prefix, which, name, f.get_tensor(name)):
                return True
        except ValueError as e:
            raise ValueError(f"{path.name}: {e}") from None
    return False


def _missing(model: nn.Module, params: dict, done: dict[int, set], naming: CheckpointNaming, hub: bool) -> list[str]:
    """Checkpoint names never loaded: whole parameters, or single sections (or experts) of merged ones."""
    owner = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), module)
    missing, seen = set(), set()
    for name, p in params.items():
        if id(p) in seen:
            continue
        seen.add(id(p))
        got = done.get(id(p), set())
        if None in got:
            continue
        moe = hasattr(p, "moe_param")
        shard_ids = getattr(p, "shard_ids", None) or getattr(owner[id(p)], "shard_ids", (None,))
        if moe and not hub and not got:  # a checkpoint of stacked experts lacks this stack
            missing.add(naming.to_checkpoint(name, None, hub=False, moe=True))
        elif len(shard_ids) > 1:
            missing.update(naming.to_checkpoint(name, s, hub, moe) for s in shard_ids if s not in got)
        elif not got:
            missing.add(naming.to_checkpoint(name, None, hub, moe))
    return sorted(missing)


def checkpoint_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> shape of each tensor a hub checkpoint of this (TP/EP size 1) model holds: q/k/v and
    gate/up apart as the family's mapping says, experts one tensor each under the hub's names
    (benchmarks write random checkpoints from it)."""
    naming = CheckpointNaming.of(model)
    out = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            for (leaf, sid), shape in module.checkpoint_shapes().items():
                out[naming.to_checkpoint(f"{mod_name}.{leaf}", sid, moe=True)] = shape
            continue
        for p_name, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            sizes, dim = getattr(module, "output_sizes", None), getattr(p, "output_dim", None)
            if sizes and len(sizes) > 1 and dim is not None and naming.packed:
                for sid, n in zip(module.shard_ids, sizes, strict=True):
                    shape = list(p.shape)
                    shape[dim] = n
                    out[naming.to_checkpoint(name, sid)] = tuple(shape)
            else:
                out[naming.to_checkpoint(name, None)] = tuple(p.shape)
    return out
