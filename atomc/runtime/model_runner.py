"""ModelRunner: owns the model, its KV cache and the sampler on one device, and runs one step.

`launch(StepInput)` runs the step the engine describes (atomc/runtime/batch.py): the flat batch
and attention metadata go to the device (or into a CUDA graph's static buffers), the forward runs
(eager, or the compiled artifact: same signature), logits are computed only for the rows that
sample, and those are sampled; the returned `PendingStep` yields a `StepResult`. The runner reads
nothing of the engine's objects, so the same record drives a runner in another process.

Tensor parallelism (`parallel.size > 1`, inside a process that joined the ranks,
atomc/runtime/distributed.py): the model loads its shard, the ranks agree on the smallest KV pool,
and every rank runs the same forwards (the layers' collectives inside). Rank 0 samples and
broadcasts the sampled ids; a worker receives them instead of sampling (it needs them for the next
step's pending feeds, as the driver does) and returns no result. A pipeline stage's runner is the
subclass in atomc/runtime/stage_runner.py; its KV cache holds its own layers' pages (None for the
other stages' layers), and the stages agree on the block counts as tensor-parallel ranks do.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from atomc import compat
from atomc.config import EngineConfig
from atomc.forward_context import AttentionMetadata, ForwardContext, group_context, set_forward_context
from atomc.kernels.registry import choose_backend, ensure_registered, kv_cache_layout
from atomc.kv_spec import blocks_per_sequence, kv_cache_groups, kv_cache_torch_dtype
from atomc.platforms import platform_of
from atomc.runtime import distributed
from atomc.runtime.batch import (
    StepInput,
    StepResult,
    group_array_name,
    prefill_step_input,
    write_batch_arrays,
)
from atomc.runtime.capture_sizes import decode_graph_sizes, warm_up_sizes
from atomc.runtime.cudagraph import DecodeGraphs, MixedGraphs, default_mixed_sizes
from atomc.runtime.device_init import DeviceInit
from atomc.runtime.fp8_kv import check_fp8_kv_supported, is_fp8, kv_scale_tensors
from atomc.runtime.greedy import warm_greedy
from atomc.runtime.kv_cache import allocate_kv_cache, bytes_per_block, scale_kv_blocks, split_kv_blocks
from atomc.runtime.sampler import (
    PendingSample,
    Sampler,
    SamplingBatch,
    apply_token_bitmask,
    prompt_logprob_entries,
)
from atomc.runtime.transfer import to_device
from models.arch import ModelArch
from models.layers.parallel import SINGLE, ParallelInfo
from models.loader import load_model

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        arch: ModelArch,
        device: str,
        dtype: torch.dtype,
        max_model_len: int,
        parallel: ParallelInfo = SINGLE,
    ):
        self.config, self.arch, self.device, self.dtype = config, arch, device, dtype
        self.parallel = parallel
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        # the pages' dtype (fp8: e4m3, 1 byte an element, so the same memory holds twice the blocks
        # of bf16); a bad value fails here, before the weights load
        self.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, dtype)
        t0 = time.perf_counter()
        device_init = DeviceInit(device)  # CUDA: the context is made on a thread while we import
        # backend ops (and the eager model's GPU attention kernel) defined before the first forward
        ensure_registered(platform_of(device))
        if platform_of(device) == "cuda":
            from atomc.kernels.triton import pdl

            pdl.configure(config.compile.enable_pdl)
            if config.parallel.tensor_parallel_size > 1:
                from atomc.kernels.triton import all_reduce_norm

                all_reduce_norm.configure(config.parallel.one_shot_all_reduce)
        if not config.compile.enforce_eager:
            compat.import_compiler(gpu=device_init.started)
        self.timings = {"imports_s": time.perf_counter() - t0}
        t0 = time.perf_counter()
        self.timings["device_init_wait_s"] = device_init.wait()
        self.timings["device_init_s"] = device_init.seconds
        self.model = load_model(
            model_dir, dtype, device, config.model.load_format, parallel=parallel,
            quantization=config.model.quantization,
        )  # fmt: skip
        self.timings["load_weights_s"] = time.perf_counter() - t0
        self.forward = self.model.forward
        self.kv_specs = self.model.kv_cache_specs()  # one per layer
        # FP8 pages (refused before compiling where unsupported): each layer's (k_scale, v_scale)
        # reach the kernels through the forward context
        self.kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if is_fp8(self.kv_dtype):
            check_fp8_kv_supported(self.kv_specs, device, platform_of(device))
            checkpoint_scales = getattr(self.model, "kv_cache_scales", {})
            self.kv_scales = kv_scale_tensors(checkpoint_scales, self.kv_specs, device)
        self.compile_info: dict = {}  # the artifact's key and format (read by the compile tests)
        if not config.compile.enforce_eager:
            from atomc.graphs.build import load_or_compile

            t0 = time.perf_counter()
            self.forward, self.compile_info = load_or_compile(self.model, model_dir, config, device, dtype)
            self.timings["compile_or_load_s"] = time.perf_counter() - t0
        # layers that share block ids (full attention; each sliding window): one pool per group
        self.kv_groups = kv_cache_groups(self.kv_specs)
        self.layer_group = [0] * len(self.kv_specs)
        for g, group in enumerate(self.kv_groups):
            for layer in group.layers:
                self.layer_group[layer] = g
        t0 = time.perf_counter()
        self.group_num_blocks = self._num_kv_blocks()  # on a GPU: the first forward, where kernels compile
        if parallel.size > 1 or parallel.stages > 1:
            # one scheduler's block ids address every rank's pools (each stage's its own layers'):
            # the smallest wins, once every stage has the same KV groups
            if parallel.stages > 1:
                check_stage_kv_groups(self.kv_groups, device)
            self.group_num_blocks = distributed.min_across_ranks(self.group_num_blocks, device)
        self.timings["kv_sizing_s"] = time.perf_counter() - t0
        if str(device).startswith("cuda"):
            t0 = time.perf_counter()
            self.warm_up_prefill_sizes()
            self.timings["warm_up_s"] = time.perf_counter() - t0
        self.num_blocks = self.group_num_blocks[0]
        self.kv_caches = self._allocate_kv_cache(self.group_num_blocks)
        self.sampler = Sampler(seed=config.model.seed)
        self.decode_graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        # the last launch that sampled: its step id and sampled tokens (on the device), for feeds
        self._last_sampled: tuple[int, torch.Tensor] | None = None
        self._generators: dict[int, torch.Generator] = {}  # seq id -> generator of a seeded sequence

    def _allocate_kv_cache(self, num_blocks: int | list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`num_blocks`: pages of every layer, or one count per KV group."""
        platform = platform_of(self.device)
        per_layer = num_blocks if isinstance(num_blocks, int) else [num_blocks[g] for g in self.layer_group]
        return allocate_kv_cache(
            self.kv_specs, per_layer, self.block_size, self.kv_dtype, self.device,
            layout_of=lambda spec: kv_cache_layout(platform, spec),
        )  # fmt: skip

    def kv_group_needs(self) -> tuple[list[int], list[int]]:
        """Per KV group: the blocks one sequence of max_model_len holds at once, and the blocks its
        pool reserves (a windowed pool's null block)."""
        chunk = self.config.scheduler.max_num_batched_tokens
        needs = [
            blocks_per_sequence(g.sliding_window, self.max_model_len, chunk, self.block_size) for g in self.kv_groups
        ]
        return needs, [0 if g.sliding_window is None else 1 for g in self.kv_groups]

    def _num_kv_blocks(self) -> list[int]:
        """Blocks per KV group: `--num-kv-blocks` is the first group's pool (the others in
        proportion); else the memory budget split by what each group needs at max_model_len."""
        needs, nulls = self.kv_group_needs()
        if self.config.cache.num_kv_blocks is not None:
            return scale_kv_blocks(self.config.cache.num_kv_blocks, needs, nulls)
        per_block = [
            bytes_per_block([self.kv_specs[i] for i in g.layers], self.block_size, self.kv_dtype)
            for g in self.kv_groups
        ]
        if str(self.device).startswith("cuda"):
            budget = self._profile_cuda_budget(sum(per_block))
        else:
            budget = int(self.config.cache.cpu_kv_cache_gib * 2**30)
        return [max(1, n) for n in split_kv_blocks(budget, per_block, needs, nulls)]

    @torch.inference_mode()
    def profile_run(self) -> int:
        """One forward at the largest batch the scheduler can form, through the paged-attention path:
        `max_num_batched_tokens` prompt tokens in sequences of at most `max_model_len`, with a
        temporary KV cache just big enough for them, plus logits for `max_num_seqs` rows.
        Returns the bytes of that temporary cache (the caller leaves them out of the activation peak)."""
        sched = self.config.scheduler
        total = sched.max_num_batched_tokens
        hidden, num_blocks = self._prefill_forward(total)
        if self.parallel.last_stage:  # the LM head's rows (a pipeline stage before the last has none)
            logits = self.model.compute_logits(hidden[: min(total, sched.max_num_seqs)])
            warm_greedy(logits)  # the sampler's argmax kernels compile here, not in the first served step
        return bytes_per_block(self.kv_specs, self.block_size, self.kv_dtype) * num_blocks

    def _prefill_forward(self, total: int) -> tuple[torch.Tensor, int]:
        """A forward over `total` prompt tokens (sequences of at most max_model_len) with a temporary
        KV cache just big enough for them: (hidden states, that cache's blocks)."""
        longest = min(self.max_model_len, total)
        lens = [longest] * (total // longest) + ([total % longest] if total % longest else [])
        step = prefill_step_input(lens, self.block_size)
        ids, positions, (meta,) = device_batch(step, self.device)
        num_blocks = sum(len(t) for t in step.block_tables)
        scratch = self._allocate_kv_cache(num_blocks)  # every layer (group) reads the one table
        with set_forward_context(ForwardContext(meta, scratch, kv_scales=self.kv_scales)):
            hidden = self._profile_forward(ids, positions)
        return hidden, num_blocks

    @torch.inference_mode()
    def warm_up_prefill_sizes(self) -> list[int]:
        """Forwards at `warm_up_sizes` tokens, so the Triton kernels compile the variants those
        steps pick (the MoE and FP8 tile files choose tiles by token count) at start-up rather than
        in the middle of serving, where a compile stalls every request in flight for seconds (one did
        for about 2 s in a CONC-64 run: docs/performance.md section 27). Compiled kernels persist in
        Triton's cache, so a later start pays a forward a size. Returns the sizes run."""
        sched, comp = self.config.scheduler, self.config.compile
        graphs = not comp.enforce_eager and captures_cuda_graphs(self.device, self.model)
        captured = decode_graph_sizes(comp.cudagraph_capture_sizes, sched.max_num_seqs, sched.max_num_batched_tokens)
        sizes = warm_up_sizes(max(captured) if graphs and captured else 0, sched.max_num_batched_tokens)
        for total in sizes:
            self._prefill_forward(total)
        torch.cuda.empty_cache()  # their scratch caches and activations: back before the KV cache is made
        return sizes

    def _profile_forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.forward(ids, positions)

    def _profile_cuda_budget(self, per_block: int) -> int:
        """Bytes for the KV cache in `gpu_memory_utilization` of the card after a forward at the
        largest batch (`per_block`: bytes of one block across all layers, the least that is usable)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        scratch_bytes = self.profile_run()
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated() - before - scratch_bytes  # peak working memory
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        in_use = total - free  # weights, CUDA context, library workspaces
        budget = total * self.config.cache.gpu_memory_utilization - in_use - max(activations, 0)
        if budget < per_block:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB); "
                "raise --gpu-memory-utilization or lower --max-num-batched-tokens"
            )
        return int(budget)

    # -- one step ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, step: StepInput) -> PendingStep | None:
        """Queue this step's forward and sampling on the device; returns its result on the way back
        (None when it samples nothing and scores no prompt), without waiting for the tokens.

        Inputs still pending from the previous launch (async scheduling) are copied into the inputs
        on the device from that launch's sampled tokens. Prompt logprobs are computed here (that
        waits for the forward) and come back in the result."""
        if step.finished_seq_ids and self._generators:
            for seq_id in step.finished_seq_ids:
                self._generators.pop(seq_id, None)
        feed = self._pending_feed(step)
        prompt_logprobs: dict[int, list[dict[int, float]]] = {}
        graphs = self.decode_graphs
        key = None
        # forward + logits of every row in one graph: only worth it when every row is sampled
        if graphs is not None and len(step.sample_rows) == step.num_tokens and not step.prompt_logprobs:
            key = graphs.key_for(step.num_seqs, step.uniform_query_len())
        if key is not None:
            logits = graphs.replay(step, key, feed=feed)
        else:
            if self.mixed_graphs is not None and self.mixed_graphs.fits(step.num_tokens, step.num_seqs):
                hidden = self.mixed_graphs.replay(step, feed=feed)
            else:
                input_ids, positions, metas = device_batch(step, self.device)
                if feed is not None:
                    feed(input_ids)
                if len(metas) != len(self.kv_groups):
                    raise RuntimeError(f"step {step.step_id}: {len(metas)} KV groups, the model {len(self.kv_groups)}")
                with set_forward_context(group_context(metas, self.kv_caches, self.layer_group, self.kv_scales)):
                    hidden = self.forward(input_ids, positions)
            if step.prompt_logprobs:
                prompt_logprobs = self._prompt_logprobs(step, hidden)
            if not step.sample_rows:
                self._last_sampled = None
                return PendingStep(None, prompt_logprobs) if prompt_logprobs else None
            logits = self.model.compute_logits(hidden[to_device(step.sample_rows, torch.long, self.device)])
        if self.parallel.rank > 0:  # a worker: the driver samples; its ids feed the next step here too
            tokens = distributed.broadcast_tokens(None, len(step.sample_rows), self.device)
            self._last_sampled = (step.step_id, tokens)
            return None
        batch = self._sampling_batch(step)
        if step.masked_rows:
            # structured outputs: the forward is queued; sampling waits for the rows' token bitmask,
            # which the engine computes on the host meanwhile (PendingStep.finish_sampling)
            self._last_sampled = None  # no feed may read this step before it is sampled
            later = functools.partial(self._sample, step.step_id, logits, batch, step.masked_rows)
            return PendingStep(None, prompt_logprobs, later)
        return PendingStep(self._sample(step.step_id, logits, batch), prompt_logprobs)

    @torch.inference_mode()
    def _sample(
        self,
        step_id: int,
        logits: torch.Tensor,
        batch: SamplingBatch,
        masked_rows: list[int] | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> PendingSample:
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask, masked_rows)
        sample = self.sampler.sample(logits, batch)
        if self.parallel.size > 1 and self.parallel.stages == 1:  # stages feed no ids: none to broadcast
            distributed.broadcast_tokens(sample.token_ids, len(batch.params), self.device)
        self._last_sampled = (step_id, sample.token_ids)
        return sample

    def _sampling_batch(self, step: StepInput) -> SamplingBatch:
        n = len(step.sample_rows)
        # token histories only for the rows that read them (penalties, min_tokens): copying every
        # row's prompt and output each step would cost O(context) host time per sequence
        prompts: list[list[int]] = [[]] * n
        outputs: list[list[int]] = [[]] * n
        if step.token_history:
            prompts, outputs = list(prompts), list(outputs)
            for k, (prompt, output) in step.token_history.items():
                prompts[k], outputs[k] = prompt, output
        generators: list[torch.Generator | None] = [None] * n
        for k, seed in step.seeds.items():
            # one generator per seeded sequence, kept across its steps: its draws do not depend on
            # the rest of the batch; freed when the engine reports the sequence finished
            seq_id = step.sample_seq_ids[k]
            gen = self._generators.get(seq_id)
            if gen is None:
                gen = self._generators[seq_id] = torch.Generator().manual_seed(seed)
            generators[k] = gen
        return SamplingBatch(step.sampling_params, prompts, outputs, generators)

    def _pending_feed(self, step: StepInput) -> Callable | None:
        """For inputs sampled by the last launch and not read back yet: a function that writes them
        into a device input-id buffer (flat batch order), from that launch's device tokens."""
        if not step.feed_rows:
            return None
        last = self._last_sampled
        if last is None or last[0] != step.feed_step:
            launched = None if last is None else last[0]
            raise RuntimeError(
                f"step {step.step_id} feeds inputs from step {step.feed_step}, but the last launch that "
                f"sampled was {launched}"
            )
        tokens = last[1]
        dst = to_device(step.feed_rows, torch.long, self.device)
        src = to_device(step.feed_sources, torch.long, self.device)

        def feed(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, dst, tokens.index_select(0, src))

        return feed

    def _prompt_logprobs(self, step: StepInput, hidden: torch.Tensor) -> dict[int, list[dict[int, float]]]:
        """Logprob of each requested prompt token given the ones before it, and the top N per row."""
        out = {}
        for req in step.prompt_logprobs:
            rows = hidden[req.first_row : req.first_row + len(req.target_ids)]
            out[req.seq_id] = prompt_logprob_entries(req, self.model.compute_logits(rows))
        return out

    def capture_graphs(self, max_model_len: int) -> None:
        """Full CUDA graphs (CUDA only, not with enforce_eager): mixed batches first (the larger
        graphs), then pure-decode batches, all in one memory pool."""
        sched, comp = self.config.scheduler, self.config.compile
        max_blocks = (max_model_len + self.block_size - 1) // self.block_size
        use_graphs = captures_cuda_graphs(self.device, self.model)
        pool = None
        mixed = default_mixed_sizes(comp.cudagraph_mixed_max_tokens, sched.max_num_batched_tokens)
        if mixed:
            self.mixed_graphs = MixedGraphs(
                self.forward, self.kv_caches, mixed, sched.max_num_seqs, max_blocks, max_model_len, self.device,
                capture=use_graphs, layer_group=self.layer_group, kv_scales=self.kv_scales,
            )  # fmt: skip
            if use_graphs:
                self.mixed_graphs.capture()
                pool = self.mixed_graphs.pool
                self.timings["cudagraph_capture_mixed_s"] = self.mixed_graphs.capture_seconds
        # the same sizes the compile plan recorded (they are a cache-key factor)
        sizes = decode_graph_sizes(comp.cudagraph_capture_sizes, sched.max_num_seqs, sched.max_num_batched_tokens)
        self.decode_graphs = DecodeGraphs(
            self.forward, self.model.compute_logits, self.kv_caches, sizes, max_blocks, max_model_len, self.device,
            capture=use_graphs, layer_group=self.layer_group, kv_scales=self.kv_scales,
        )  # fmt: skip
        if use_graphs:
            self.decode_graphs.capture(pool)
            self.timings["cudagraph_capture_s"] = self.decode_graphs.capture_seconds


def check_stage_kv_groups(groups: list, device: str) -> None:
    """Pipeline stages size one pool per KV group for the one scheduler: every stage must hold the
    same kinds of layers (full attention, each window), else the pools do not line up."""
    windows = [g.sliding_window for g in groups]
    if not distributed.same_across_ranks(zlib.crc32(repr(windows).encode()), device):
        raise ValueError(
            f"pipeline stages hold different kinds of attention layers (this stage's KV groups: windows "
            f"{windows}); atomc needs every stage to hold each kind: try another --pipeline-parallel-size"
        )


def captures_cuda_graphs(device: str, model) -> bool:
    """CUDA graphs on CUDA, unless the model's forward cannot be captured: `cuda_graphs = False`,
    or an op in its `graphs_need_kernels` (DeepSeek: mla_attention) would run its torch reference
    here, which reads the batch's host-side lists that a captured graph would freeze. Without
    graphs the same padded batches run eagerly."""
    if not device.startswith("cuda") or not getattr(model, "cuda_graphs", True):
        return False
    platform = platform_of(device)
    return all(choose_backend(op, platform) != "torch" for op in getattr(model, "graphs_need_kernels", ()))


class PendingStep:
    """One launched step on its way back: `result()` waits for the sampled tokens (if any).

    A step with structured-output rows comes back unsampled (`needs_bitmask`): its forward is
    queued, and `finish_sampling(bitmask)` masks those rows and queues the sampling."""

    def __init__(
        self,
        sample: PendingSample | None,
        prompt_logprobs: dict[int, list[dict[int, float]]],
        sample_later: Callable[[torch.Tensor], PendingSample] | None = None,
    ):
        self._sample, self.prompt_logprobs = sample, prompt_logprobs
        self._sample_later = sample_later
        self._result: StepResult | None = None

    @property
    def needs_bitmask(self) -> bool:
        return self._sample_later is not None

    def finish_sampling(self, bitmask: torch.Tensor) -> None:
        """Sample a deferred step, its masked rows restricted by `bitmask` (see apply_token_bitmask)."""
        if self._sample_later is None:
            raise RuntimeError("this step was sampled already")
        self._sample, self._sample_later = self._sample_later(bitmask), None

    def result(self) -> StepResult:
        if self._sample_later is not None:
            raise RuntimeError("the step's structured-output rows were never given their bitmask")
        if self._result is None:
            if self._sample is None:
                self._result = StepResult([], [], self.prompt_logprobs)
            else:
                out = self._sample.result()
                self._result = StepResult(out.token_ids, out.logprobs, self.prompt_logprobs, out.num_fallbacks)
        return self._result


_ARRAYS = (  # name, numpy dtype, torch dtype: what write_batch_arrays fills
    ("input_ids", np.int64, torch.long),
    ("positions", np.int64, torch.long),
    ("slot_mapping", np.int64, torch.long),
    ("query_start_loc", np.int32, torch.int32),
    ("seq_lens", np.int32, torch.int32),
    ("block_tables", np.int32, torch.int32),
)


def device_batch(step: StepInput, device: str) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
    """Input ids, positions and the attention metadata of each KV group on `device` for a step (the
    eager path); the groups after the first differ only in their block tables and slots."""
    t, b = step.num_tokens, step.num_seqs
    width = max(map(len, step.block_tables))
    shapes = {"query_start_loc": b + 1, "seq_lens": b, "block_tables": (b, width)}
    host = {name: np.empty(shapes.get(name, t), dtype) for name, dtype, _ in _ARRAYS}
    for g in range(1, len(step.group_tables) + 1):
        host[group_array_name("slot_mapping", g)] = np.empty(t, np.int64)
        host[group_array_name("block_tables", g)] = np.empty((b, width), np.int32)
    write_batch_arrays(step, host, t, b, 0)
    dev = {name: to_device(torch.from_numpy(host[name]), dtype, device) for name, _, dtype in _ARRAYS}
    meta = AttentionMetadata(
        slot_mapping=dev["slot_mapping"],
        query_start_loc=dev["query_start_loc"],
        seq_lens=dev["seq_lens"],
        block_tables=dev["block_tables"],
        query_start_loc_host=host["query_start_loc"].tolist(),
        seq_lens_host=host["seq_lens"].tolist(),
        max_query_len=max(step.query_lens),
        max_seq_len=int(host["seq_lens"].max()),
        num_seqs=b,
    )
    metas = [meta]
    for g in range(1, len(step.group_tables) + 1):
        slots = to_device(torch.from_numpy(host[group_array_name("slot_mapping", g)]), torch.long, device)
        tables = to_device(torch.from_numpy(host[group_array_name("block_tables", g)]), torch.int32, device)
        metas.append(dataclasses.replace(meta, slot_mapping=slots, block_tables=tables))
    return dev["input_ids"], dev["positions"], metas
