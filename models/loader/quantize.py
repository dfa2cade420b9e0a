"""Give each linear of a built model its linear method from the quantisation spec (models/quant/spec.py).

Runs on the meta model, before any tensor is read: a layer's method decides which parameters it has
(fp8 weight + scales), so the checkpoint's tensors then load through the usual weight_loaders. The
spec speaks of the checkpoint's module names, so a merged layer (qkv_proj, gate_up_proj) asks for
each section's name (q_proj, k_proj, v_proj) and needs one answer. MoE routers stay unquantised.
A spec with an experts format (MXFP4) gives each FusedMoE it does not skip that format's MoE method
(models/quant/mxfp4.py); FP8 experts are not built yet, so an FP8 spec on a MoE model is refused.
"""

from __future__ import annotations

from torch import nn

from models.layers.linear import LinearBase
from models.layers.moe import FusedMoE, SparseMoEBlock
from models.quant.fp8 import method_for
from models.quant.mxfp4 import MOE_METHODS
from models.quant.spec import FP8Scheme, QuantConfigError, QuantSpec


def apply_quantization(model: nn.Module, spec: QuantSpec | None, naming) -> dict[str, FP8Scheme]:
    """Set the FP8 method of every linear the spec quantises; {module name: scheme} of those.
    `naming` is the model's CheckpointNaming."""
    if spec is None:
        return {}
    if spec.experts is not None:
        _set_expert_methods(model, spec, naming)
    elif any(isinstance(m, FusedMoE) for m in model.modules()):
        raise QuantConfigError(
            f"{spec.method} quantisation of a mixture-of-experts model: FP8 experts are not supported yet"
        )
    routers = {id(m.gate) for m in model.modules() if isinstance(m, SparseMoEBlock)}
    chosen: dict[str, FP8Scheme] = {}
    aliases: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or id(module) in routers:
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
        if scheme is None:
            continue
        module.set_linear_method(method_for(scheme))
        chosen[name] = scheme
        aliases.update(scheme.aliases)
    model.quant_tensor_aliases = aliases  # checkpoint tensor leaf name -> ours (load_weights)
    model.quant_schemes = chosen
    return chosen


def _set_expert_methods(model: nn.Module, spec: QuantSpec, naming) -> None:
    """Each FusedMoE the spec does not skip stores its experts in the spec's format."""
    if not any(isinstance(m, FusedMoE) for m in model.modules()):
        raise QuantConfigError(
            f"quantization_config.quant_method {spec.method} quantises MoE experts, but this model has none"
        )
    for name, module in model.named_modules():
        if not isinstance(module, FusedMoE):
            continue
        ckpt_name = naming.to_checkpoint(f"{name}.w13_weight", None, moe=True, hub=False).rpartition(".")[0]
        fmt = spec.experts_format_for(ckpt_name)
        if fmt is not None:
            module.set_moe_method(MOE_METHODS[fmt]())
