"""A checkpoint's `quantization_config` (or `--quantization fp8`) -> the FP8 scheme of each linear.

Three on-disk dialects describe the same few schemes, so they are parsed into one small vocabulary
(`FP8Scheme`) and the linear methods (models/quant/fp8.py) know only that:

- HF / vLLM `quant_method: fp8`: `activation_scheme` static|dynamic; `weight_block_size` [bn, bk]
  for block FP8 (DeepSeek-V3/R1, Qwen3-FP8: `weight_scale_inv` per block, activations quantised per
  token-group of bk at run time), none for per-tensor (`weight_scale` or, as transformers writes
  it, `weight_scale_inv`; `input_scale` / `activation_scale` when static); skips in
  `modules_to_not_convert` or `ignored_layers`.
- compressed-tensors (what llmcompressor writes): `config_groups` of `targets` + `weights` +
  `input_activations` (`type: float`, `num_bits: 8`, `strategy` tensor|channel|token|group|block,
  `dynamic`), `ignore` (names or `re:` patterns), format `float-quantized`.
- transformers / GPT-OSS `quant_method: mxfp4`: MoE experts in MXFP4 (`experts`), linears as
  stored; `modules_to_not_convert` (fnmatch patterns, a parent module's name covers its children).
- AMD Quark: `global_quant_config`, per-name `layer_quant_config` (fnmatch patterns),
  `layer_type_quant_config`, `exclude`; `weight` / `input_tensors` with `dtype: fp8_e4m3`,
  `qscheme` per_tensor|per_channel, `is_dynamic` (per_channel input = per token).

Names in skip lists and patterns are the checkpoint's module names (`...q_proj`), so a merged layer
(qkv_proj) asks for each of its checkpoint sections; they must agree. MoE experts under an FP8
config ask the same per expert projection (`experts_scheme_for`), and `experts_format` maps the
agreed scheme to atomc::moe_quant's weight-only format (block 128x128 -> fp8_block, else
fp8_channel). Anything atomc cannot run, or that contradicts itself, raises `QuantConfigError`
naming the field.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MOE_BLOCK = 128  # the block of atomc::moe_quant's fp8_block experts (atomc/ops/moe_quant.py)
ONLINE_METHODS = ("fp8",)  # --quantization values


class QuantConfigError(ValueError):
    """An unsupported or inconsistent quantization_config; the message names the field."""


@dataclass(frozen=True)
class FP8Scheme:
    """How one linear is stored and run.

    weight: "tensor" (one scale per checkpoint tensor), "channel" (one per output row) or "block"
    (one per `block` = (rows, cols) tile). activation: "static" (a per-tensor scale from the
    checkpoint), "tensor" / "token" (dynamic: one scale per call / per row) or "group" (dynamic,
    one per `block[1]` values of a row). `online`: the checkpoint holds unquantised weights that
    are quantised at load. `aliases`: checkpoint tensor name -> ours, for writers that spell a
    scale differently."""

    weight: str
    activation: str
    block: tuple[int, int] | None = None
    online: bool = False
    aliases: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        ok = {
            "tensor": ("static", "tensor", "token"),
            "channel": ("static", "tensor", "token"),
            "block": ("group",),
        }
        if self.activation not in ok.get(self.weight, ()):
            raise QuantConfigError(f"FP8 {self.weight} weights with {self.activation} activations are not supported")
        if (self.weight == "block") != (self.block is not None):
            raise QuantConfigError("a block size goes with block weights only")

    def describe(self) -> str:
        w = f"block {self.block[0]}x{self.block[1]}" if self.block else f"per-{self.weight}"
        a = {"static": "static per-tensor", "tensor": "dynamic per-tensor", "token": "dynamic per-token"}
        act = a.get(self.activation, f"dynamic per-token-group {self.block[1] if self.block else ''}")
        return f"fp8 {w} weights, {act} activations" + (" (quantised at load)" if self.online else "")


@dataclass(frozen=True)
class QuantSpec:
    """The scheme per checkpoint module name: `default`, overridden by the first matching
    `(pattern, scheme or None)` in `rules`; names matching `ignore` stay unquantised."""

    method: str  # fp8 | compressed-tensors | quark | online:fp8
    default: FP8Scheme | None
    rules: tuple[tuple[str, FP8Scheme | None], ...] = ()
    ignore: tuple[str, ...] = ()
    matcher: str = "exact"  # how patterns match: "exact" (+ re:), "fnmatch", "suffix"
    # an experts-only spec's MoE weight format (atomc::moe_quant's): "mxfp4"; None: experts follow the
    # linear rules (an FP8 spec: experts_scheme_for) or stay dense
    experts: str | None = None

    def experts_format_for(self, module: str) -> str | None:
        """The weight format of the FusedMoE called `module` (checkpoint name) in an experts-only spec
        (MXFP4), None to keep it dense: a skip pattern naming it or any module above it keeps it dense."""
        if self._skips_module_or_parent(module):
            return None
        return self.experts

    def experts_scheme_for(self, module: str, expert_modules: list[str]) -> FP8Scheme | None:
        """The FP8 scheme of the FusedMoE called `module` (checkpoint name) in an FP8 spec, None to keep
        it dense. `expert_modules`: the checkpoint module names of its per-expert projections (every
        expert's gate, up and down); each gets its linear rule (skip lists, targets), and as the
        experts run as one stacked op they must all agree."""
        if self._skips_module_or_parent(module):
            return None
        schemes: dict[FP8Scheme | None, str] = {}
        for name in expert_modules:
            schemes.setdefault(self.scheme_for(name), name)
        if len(schemes) > 1:
            listed = ", ".join(f"{name}: {s.describe() if s else 'unquantised'}" for s, name in schemes.items())
            raise QuantConfigError(
                f"quantization_config gives the experts of {module} different schemes ({listed}); "
                "atomc stacks every expert of a layer into one MoE op, so they must agree"
            )
        return next(iter(schemes), None)

    def _skips_module_or_parent(self, module: str) -> bool:
        parts = module.split(".")
        names = [".".join(parts[:n]) for n in range(1, len(parts) + 1)]
        return any(_matches(p, name, self.matcher) for p in self.ignore for name in names)

    def scheme_for(self, module: str) -> FP8Scheme | None:
        if any(_matches(p, module, self.matcher) for p in self.ignore):
            return None
        for pattern, scheme in self.rules:
            if _matches(pattern, module, self.matcher):
                return scheme
        return self.default

    def key(self) -> dict:
        """A JSON-able summary (reports): the method, the default linear scheme, and the format MoE
        experts take (MXFP4's, or what the default FP8 scheme makes of them) where there is one."""
        key = {"method": self.method, "default": self.default.describe() if self.default else None}
        experts = self.experts
        if experts is None and self.default is not None:
            try:
                experts = experts_format(self.default, self.method)
            except QuantConfigError:  # a block size experts cannot take (a dense model's linears can)
                experts = None
        return key | ({"experts": experts} if experts else {})


# where each dialect writes its block size (for the error naming it)
_BLOCK_FIELDS = {
    "fp8": "quantization_config.weight_block_size",
    "compressed-tensors": "quantization_config.config_groups.*.weights.block_structure",
}


def experts_format(scheme: FP8Scheme, method: str) -> str:
    """The atomc::moe_quant weight format FP8 experts of `scheme` load into. The MoE op runs them
    weight-only (activations stay in the model dtype), so only the weight side maps: block 128x128
    -> "fp8_block"; per-channel, per-tensor (its scale repeated on each row) and online -> "fp8_channel"."""
    if scheme.weight == "block":
        if tuple(scheme.block) != (FP8_MOE_BLOCK, FP8_MOE_BLOCK):
            field_ = _BLOCK_FIELDS.get(method, "the weight block size")
            raise QuantConfigError(
                f"{field_} {list(scheme.block)}: FP8 MoE experts run {FP8_MOE_BLOCK}x{FP8_MOE_BLOCK} blocks only "
                "(atomc::moe_quant's fp8_block)"
            )
        return "fp8_block"
    return "fp8_channel"


def _matches(pattern: str, name: str, matcher: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if matcher == "fnmatch" and ("*" in pattern or "?" in pattern):
        return fnmatch.fnmatchcase(name, pattern)
    # exact names, or a trailing component path ("lm_head", "mlp.gate" match "model.layers.0.mlp.gate")
    return name == pattern or name.endswith("." + pattern)


def online_spec(method: str) -> QuantSpec:
    if method not in ONLINE_METHODS:
        raise QuantConfigError(f"--quantization {method!r} is not one of: {', '.join(ONLINE_METHODS)}")
    return QuantSpec("online:fp8", FP8Scheme("channel", "token", online=True))


def resolve(raw_config: dict, online: str | None = None) -> QuantSpec | None:
    """The spec for a checkpoint's config.json (`raw_config`) and the `--quantization` flag."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return online_spec(online) if online else None
    spec = parse_quantization_config(qc)
    if online and online != spec.method:
        raise QuantConfigError(
            f"--quantization {online} was asked for, but the checkpoint is already quantised "
            f"(quantization_config.quant_method: {spec.method}); leave the flag out"
        )
    return spec


def parse_quantization_config(qc: dict) -> QuantSpec:
    if not isinstance(qc, dict):
        raise QuantConfigError("quantization_config must be a JSON object")
    method = qc.get("quant_method")
    parsers = {
        "fp8": _parse_hf_fp8,
        "compressed-tensors": _parse_compressed_tensors,
        "quark": _parse_quark,
        "mxfp4": _parse_mxfp4,
    }
    if method not in parsers:
        raise QuantConfigError(
            f"quantization_config.quant_method {method!r} is not supported; atomc reads: {', '.join(parsers)}"
        )
    return parsers[method](qc)


# ---- HF / vLLM "fp8" ----


def _parse_hf_fp8(qc: dict) -> QuantSpec:
    field_ = "quantization_config"
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantConfigError(f"{field_}.fmt {fmt!r} is not supported (only e4m3)")
    if qc.get("scale_fmt", "float") != "float":
        raise QuantConfigError(f"{field_}.scale_fmt {qc['scale_fmt']!r} is not supported (only float scales)")
    act = qc.get("activation_scheme", "dynamic")
    if act not in ("static", "dynamic"):
        raise QuantConfigError(f"{field_}.activation_scheme {act!r} is not one of: static, dynamic")
    block = qc.get("weight_block_size")
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    if block is not None:
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantConfigError(f"{field_}.weight_block_size {block!r} must be two positive integers")
        if act == "static":
            raise QuantConfigError(
                f"{field_}.activation_scheme static with weight_block_size: block FP8 quantises "
                "activations per token group at run time (dynamic)"
            )
        return QuantSpec("fp8", FP8Scheme("block", "group", tuple(block)), ignore=ignore, matcher="suffix")
    # per-tensor: vLLM writes weight_scale / input_scale, transformers weight_scale_inv / activation_scale
    aliases = (("weight_scale_inv", "weight_scale"), ("activation_scale", "input_scale"))
    scheme = FP8Scheme("tensor", "static" if act == "static" else "tensor", aliases=aliases)
    return QuantSpec("fp8", scheme, ignore=ignore, matcher="suffix")


# ---- MXFP4 (GPT-OSS) ----


def _parse_mxfp4(qc: dict) -> QuantSpec:
    """transformers' Mxfp4Config: the MoE experts are MXFP4, every linear stays as the checkpoint
    stores it (GPT-OSS lists its attention, router, embeddings and head in modules_to_not_convert)."""
    skip = qc.get("modules_to_not_convert") or ()
    if not isinstance(skip, list | tuple) or not all(isinstance(m, str) for m in skip):
        raise QuantConfigError(f"quantization_config.modules_to_not_convert {skip!r} must be a list of module names")
    return QuantSpec("mxfp4", None, ignore=tuple(skip), matcher="fnmatch", experts="mxfp4")


# ---- compressed-tensors ----

_CT_FORMATS = ("float-quantized", "naive-quantized")


def _ct_args(args: dict | None, where: str, kind: str) -> dict | None:
    if args is None:
        return None
    if not isinstance(args, dict):
        raise QuantConfigError(f"{where}.{kind} must be an object")
    for key, want in (("type", "float"), ("num_bits", 8), ("symmetric", True)):
        got = args.get(key, True if key == "symmetric" else None)
        if got != want:
            raise QuantConfigError(f"{where}.{kind}.{key} is {got!r}; atomc reads FP8 ({key}: {want!r})")
    return args


def _ct_scheme(group: dict, where: str) -> FP8Scheme:
    w = _ct_args(group.get("weights"), where, "weights")
    a = _ct_args(group.get("input_activations"), where, "input_activations")
    if w is None:
        raise QuantConfigError(f"{where}.weights is missing: activation-only quantisation is not supported")
    if a is None:
        raise QuantConfigError(f"{where}.input_activations is missing: FP8 weight-only (W8A16) is not supported yet")
    if group.get("output_activations") is not None:
        raise QuantConfigError(f"{where}.output_activations: quantised outputs are not supported")
    if w.get("dynamic"):
        raise QuantConfigError(f"{where}.weights.dynamic is true: weights must carry static scales")
    ws, as_, dyn = w.get("strategy"), a.get("strategy"), a.get("dynamic")
    if dyn not in (True, False):
        raise QuantConfigError(f"{where}.input_activations.dynamic {dyn!r} is not supported (true or false)")
    if ws == "block":
        block = w.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2):
            raise QuantConfigError(f"{where}.weights.block_structure {block!r} must be [rows, cols]")
        if as_ != "group" or not dyn or a.get("group_size") != block[1]:
            raise QuantConfigError(
                f"{where}.input_activations must be dynamic strategy group with group_size {block[1]} "
                f"(the weight block's columns) for block weights; got strategy {as_!r}, dynamic {dyn!r}, "
                f"group_size {a.get('group_size')!r}"
            )
        return FP8Scheme("block", "group", tuple(block), aliases=(("weight_scale", "weight_scale_inv"),))
    if ws not in ("tensor", "channel"):
        raise QuantConfigError(f"{where}.weights.strategy {ws!r} is not one of: tensor, channel, block")
    if as_ == "tensor":
        act = "tensor" if dyn else "static"
    elif as_ == "token" and dyn:
        act = "token"
    else:
        raise QuantConfigError(
            f"{where}.input_activations.strategy {as_!r} (dynamic {dyn!r}) is not supported with {ws} weights "
            "(tensor, static or dynamic; token, dynamic)"
        )
    return FP8Scheme(ws, act)


def _check_ct_kv_cache_scheme(kv: dict) -> None:
    """compressed-tensors' `kv_cache_scheme`: calibrated per-tensor FP8 k and v scales, which the
    checkpoint ships as `self_attn.k_scale` / `v_scale` (models/loader/kv_scales.py) and
    `--kv-cache-dtype fp8` uses. Anything else is refused, naming the field."""
    where = "quantization_config.kv_cache_scheme"
    if not isinstance(kv, dict):
        raise QuantConfigError(f"{where} is not a mapping")
    want = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}
    for key, value in want.items():
        if kv.get(key, value if key == "dynamic" else None) != value:
            raise QuantConfigError(
                f"{where}.{key} {kv.get(key)!r} is not supported: atomc reads static per-tensor FP8 KV scales "
                "(type float, num_bits 8, strategy tensor, dynamic false)"
            )


def _parse_compressed_tensors(qc: dict) -> QuantSpec:
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        raise QuantConfigError(f"quantization_config.format {fmt!r} is not one of: {', '.join(_CT_FORMATS)}")
    if qc.get("kv_cache_scheme") is not None:
        _check_ct_kv_cache_scheme(qc["kv_cache_scheme"])
    if qc.get("sparsity_config"):
        raise QuantConfigError("quantization_config.sparsity_config: sparse checkpoints are not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantConfigError("quantization_config.config_groups is missing or empty")
    rules: list[tuple[str, FP8Scheme]] = []
    default = None
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        if (group.get("format") or fmt) not in _CT_FORMATS:  # a null group format is the top one
            raise QuantConfigError(f"{where}.format {group['format']!r} is not one of: {', '.join(_CT_FORMATS)}")
        scheme = _ct_scheme(group, where)
        targets = group.get("targets") or []
        if not targets:
            raise QuantConfigError(f"{where}.targets is empty")
        for t in targets:
            if t == "Linear":  # every linear layer
                if default is not None and default != scheme:
                    raise QuantConfigError(f"{where}.targets: two groups target every Linear with different schemes")
                default = scheme
            else:
                rules.append((t, scheme))
    return QuantSpec("compressed-tensors", default, tuple(rules), tuple(qc.get("ignore") or ()), "exact")


# ---- AMD Quark ----


def _quark_scheme(cfg: dict | None, where: str) -> FP8Scheme | None:
    if cfg is None:
        return None
    for key in ("output_tensors", "bias"):
        if cfg.get(key) is not None:
            what = "quantised outputs (an FP8 KV cache)" if key == "output_tensors" else "a quantised bias"
            raise QuantConfigError(f"{where}.{key}: {what} is not supported yet")
    w, a = cfg.get("weight"), cfg.get("input_tensors")
    if w is None:
        return None  # an unquantised entry
    if isinstance(w, list) or isinstance(a, list):
        raise QuantConfigError(f"{where}.weight: two-level (mixed) Quark schemes are not supported")
    if w.get("dtype") != "fp8_e4m3":
        raise QuantConfigError(f"{where}.weight.dtype {w.get('dtype')!r} is not supported (only fp8_e4m3)")
    if w.get("is_dynamic"):
        raise QuantConfigError(f"{where}.weight.is_dynamic is true: weights must carry static scales")
    qs = w.get("qscheme")
    if qs not in ("per_tensor", "per_channel"):
        raise QuantConfigError(f"{where}.weight.qscheme {qs!r} is not one of: per_tensor, per_channel")
    if a is None:
        raise QuantConfigError(f"{where}.input_tensors is null: FP8 weight-only (W8A16) is not supported yet")
    if a.get("dtype") != "fp8_e4m3":
        raise QuantConfigError(f"{where}.input_tensors.dtype {a.get('dtype')!r} is not supported (only fp8_e4m3)")
    aq, dyn = a.get("qscheme"), bool(a.get("is_dynamic"))
    if aq == "per_tensor":
        act = "tensor" if dyn else "static"
    elif aq == "per_channel" and dyn:  # Quark's per-channel input = one scale per token
        act = "token"
    else:
        raise QuantConfigError(
            f"{where}.input_tensors.qscheme {aq!r} (is_dynamic {dyn}) is not supported "
            "(per_tensor, static or dynamic; per_channel, dynamic)"
        )
    return FP8Scheme("tensor" if qs == "per_tensor" else "channel", act)


def _parse_quark(qc: dict) -> QuantSpec:
    export = qc.get("export") or {}
    if export.get("weight_format", "real_quantized") != "real_quantized":
        raise QuantConfigError(
            f"quantization_config.export.weight_format {export['weight_format']!r}: atomc reads real_quantized "
            "checkpoints only"
        )
    if export.get("kv_cache_group"):
        raise QuantConfigError(
            "quantization_config.export.kv_cache_group: Quark's KV-cache quantisation is not read yet "
            "(--kv-cache-dtype fp8 runs such a model with KV scales 1.0 once this entry is removed)"
        )
    if qc.get("layer_type_quant_config"):
        raise QuantConfigError(
            "quantization_config.layer_type_quant_config: per-layer-type overrides are not supported"
        )
    default = _quark_scheme(qc.get("global_quant_config"), "quantization_config.global_quant_config")
    rules = tuple(
        (pattern, _quark_scheme(cfg, f"quantization_config.layer_quant_config.{pattern}"))
        for pattern, cfg in (qc.get("layer_quant_config") or {}).items()
    )
    return QuantSpec("quark", default, rules, tuple(qc.get("exclude") or ()), "fnmatch")
