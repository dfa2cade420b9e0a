"""Give each linear of a built model its linear method from the quantisation spec (models/quant/spec.py).

Runs on the meta model, before any tensor is read: a layer's method decides which parameters it has
(fp8 weight + scales), so the checkpoint's tensors then load through the usual weight_loaders. The
spec speaks of the checkpoint's module names, so a merged layer (qkv_proj, gate_up_proj) asks for
each section's name (q_proj, k_proj, v_proj) and needs one answer. MoE routers stay unquantised
(SparseMoEBlock's gate, or a linear flagged `router`); a linear flagged `dense_weight` (DeepSeek's
kv_b_proj) is dequantised after loading from block FP8, and stays dense under online FP8.
Each FusedMoE gets an MoE method: an experts-only spec's format (MXFP4, models/quant/mxfp4.py), or
under an FP8 spec the scheme its per-expert projections get by the linear rules, all the same
(FP8 experts, models/quant/fp8_moe.py); a skip list naming the block or every expert keeps it dense.
"""

from __future__ import annotations

from torch import nn

from models.layers.linear import LinearBase
from models.layers.moe import FusedMoE, SparseMoEBlock
from models.quant.fp8 import method_for
from models.quant.fp8_moe import Fp8MoEMethod
from models.quant.mxfp4 import MOE_METHODS
from models.quant.spec import FP8Scheme, QuantConfigError, QuantSpec


def apply_quantization(model: nn.Module, spec: QuantSpec | None, naming) -> dict[str, FP8Scheme]:
    """Set the FP8 method of every linear the spec quantises; {module name: scheme} of those.
    `naming` is the model's CheckpointNaming."""
    if spec is None:
        return {}
    aliases: dict[str, str] = _set_expert_methods(model, spec, naming)
    routers = {id(m.gate) for m in model.modules() if isinstance(m, SparseMoEBlock)}
    chosen: dict[str, FP8Scheme] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or module.router or id(module) in routers:
            continue
        sections = [naming.to_checkpoint(f"{name}.weight", sid).removesuffix(".weight") for sid in module.shard_ids]
        schemes = {s: spec.scheme_for(s) for s in sections}
        if len(set(schemes.values())) > 1:
            listed = ", ".join(f"{s}: {v.describe() if v else 'unquantised'}" for s, v in schemes.items())
            raise QuantConfigError(
                f"quantization_config gives the sections of {name} different schemes ({listed}); "
                "atomc runs them as one GEMM, so they must agree"
            )
        scheme = schemes[sections[0]]
        method = None if scheme is None else method_for(scheme, module.dense_weight)
        if method is None:
            continue
        module.set_linear_method(method)
        chosen[name] = scheme
        aliases.update(scheme.aliases)
    model.quant_tensor_aliases = aliases  # checkpoint tensor leaf name -> ours (load_weights)
    model.quant_schemes = chosen
    return chosen


def _set_expert_methods(model: nn.Module, spec: QuantSpec, naming) -> dict[str, str]:
    """Each FusedMoE the spec quantises stores its experts in that format; the checkpoint's other
    spellings of their tensors' names (for the loader)."""
    moes = [(name, m) for name, m in model.named_modules() if isinstance(m, FusedMoE)]
    if spec.experts is not None and not moes:
        raise QuantConfigError(
            f"quantization_config.quant_method {spec.method} quantises MoE experts, but this model has none"
        )
    aliases: dict[str, str] = {}
    for name, module in moes:
        ckpt_name = naming.to_checkpoint(f"{name}.w13_weight", None, moe=True, hub=False).rpartition(".")[0]
        if spec.experts is not None:
            fmt = spec.experts_format_for(ckpt_name)
            if fmt is not None:
                module.set_moe_method(MOE_METHODS[fmt]())
            continue
        # under an FP8 spec: the hub's names (the skip lists' and targets'), every expert's projections
        hub_name = naming.to_checkpoint(f"{name}.w13_weight", None, moe=True).rpartition(".")[0]
        projections = [
            naming.to_checkpoint(f"{name}.{leaf}", sid, moe=True).removesuffix(".weight")
            for leaf in ("w13_weight", "w2_weight")
            for sid in module.shard_ids_of(leaf)
        ]
        scheme = spec.experts_scheme_for(hub_name, projections)
        if scheme is not None:
            method = Fp8MoEMethod(scheme, spec.method)
            module.set_moe_method(method)
            aliases.update(method.aliases)
    return aliases
