"""The compiled decode step of the CUDA pipeline makes no tensor copy between its kernels (and gives the eager values).

Traced and compiled as the engine does (Dynamo, atomc's CUDA passes, Inductor with graph partition;
`aot_trace`), on the CPU: the atomc_triton ops run their Triton kernels through the interpreter, over
a paged cache. Each copy counted here would be a device-to-device memcpy in the decode CUDA graph
(`memcpy32_post`): the fused RoPE + KV-write op used to rotate a clone of q and of k, two a layer
(Llama-3.1-8B's 32 layers, Qwen3-30B-A3B's 48 on the H200), and two more a layer past batch 1, where
the qkv slices are not contiguous.
"""

from __future__ import annotations

import pytest
import torch

from atomc.forward_context import set_forward_context
from atomc.graphs.trace import AtomcBackend, aot_trace, bind
from atomc.passes import PassManager
from models.loader import load_model
from tests.device_copies import copies_outside_kernels
from tests.passes.test_pipeline import _one_sequence_context

if torch.cuda.is_available():  # triton then compiles for the GPU, and these are CPU tensors
    pytest.skip("runs the Triton kernels through the interpreter, on machines without CUDA", allow_module_level=True)


# Llama: plain RoPE + KV write; Qwen3-MoE: the q/k-norm variant and the MoE op
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_cuda_decode_step_copies_nothing(checkpoints, family):
    dtype = torch.float16  # the engine's half-precision path (the interpreter mishandles bf16)
    model = load_model(checkpoints[family], dtype, "cpu")
    backend = AtomcBackend(PassManager.for_platform("cuda"))
    forward = bind(aot_trace(model, "cpu", backend), model)
    assert "atomc_triton.paged_attention" in backend.record.graph_module.code  # the lowered graph
    a = model.arch
    shape = (2 * a.num_layers, 4, 16, a.num_kv_heads, a.head_dim)
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(0))
    runs = {name: (fn, list(zip(*torch.zeros(shape, dtype=dtype).chunk(2), strict=True))) for name, fn in
            (("compiled", forward), ("eager", model.forward))}  # fmt: skip

    def step(name: str, start: int, n: int) -> torch.Tensor:
        fn, caches = runs[name]
        with set_forward_context(_one_sequence_context(start, n, caches)):
            return fn(ids[start : start + n], torch.arange(start, start + n))

    copies, got, want = [], [], []
    with torch.no_grad():
        for start, n in ((0, 20), (20, 1), (21, 3)):  # prefill, a decode row, 3 rows (slices not contiguous)
            copies.append(copies_outside_kernels(lambda: got.append(step("compiled", start, n))))  # noqa: B023
            want.append(step("eager", start, n))
    assert copies == [{}, {}, {}]
    for g, w in zip(got, want, strict=True):  # the eager model's values (its torch references), to fp16 rounding
        torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-2)  # measured: 2e-3 to 4e-3 on values up to 3.7
