"""ModelRunner: owns the model, its KV cache and the sampler on one device, and runs one step.

It turns scheduled sequences into a flat token batch plus attention metadata, runs the forward
(eager, or the compiled artifact: same signature), computes logits only for rows that sample, and
samples. Tensor parallelism slots in here: one runner per GPU process, each holding its shard of
the weights and of the KV heads (see docs/architecture.md).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from atomc.config import EngineConfig
from atomc.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from atomc.graphs.partition import resolve_capture_sizes
from atomc.kernels.registry import ensure_registered
from atomc.platforms import platform_of
from atomc.runtime.cudagraph import DecodeGraphs, MixedGraphs, default_mixed_sizes
from atomc.runtime.kv_cache import allocate_kv_cache, bytes_per_block
from atomc.runtime.sampler import PendingSample, Sampler, SamplingBatch
from atomc.runtime.transfer import to_device
from models.arch import ModelArch
from models.loader import load_model

if TYPE_CHECKING:  # the runner only reads these; the scheduler lives downstream of it
    from atomc.engine.scheduler import ScheduledSeq

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
    ):
        self.config, self.arch, self.device, self.dtype = config, arch, device, dtype
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        t0 = time.perf_counter()
        # backend ops (and the eager model's GPU attention kernel) defined before the first forward
        ensure_registered(platform_of(device))
        self.model = load_model(model_dir, dtype, device, config.model.load_format)
        self.timings = {"load_weights_s": time.perf_counter() - t0}
        self.forward = self.model.forward
        self.compile_info: dict = {}
        if not config.compile.enforce_eager:
            from atomc.graphs.build import load_or_compile

            t0 = time.perf_counter()
            self.forward, self.compile_info = load_or_compile(self.model, model_dir, config, device, dtype)
            self.timings["compile_or_load_s"] = time.perf_counter() - t0
        self.kv_dtype = dtype if config.cache.kv_cache_dtype == "auto" else getattr(torch, config.cache.kv_cache_dtype)
        self.num_blocks = self._num_kv_blocks()
        self.kv_caches = allocate_kv_cache(
            arch.num_layers,
            self.num_blocks,
            self.block_size,
            arch.num_kv_heads,
            arch.head_dim,
            self.kv_dtype,
            device,
        )
        self.sampler = Sampler(seed=config.model.seed)
        self.decode_graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.prompt_logprobs: dict[int, list[dict[int, float]]] = {}
        # the last launch's sampled tokens (on the device) and seq_id -> their row
        self._last_sampled: tuple[torch.Tensor, dict[int, int]] | None = None

    def _num_kv_blocks(self) -> int:
        per_block = bytes_per_block(
            self.arch.num_layers, self.block_size, self.arch.num_kv_heads, self.arch.head_dim, self.kv_dtype
        )
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks
        if str(self.device).startswith("cuda"):
            return self._profile_cuda_blocks(per_block)
        return max(1, int(self.config.cache.cpu_kv_cache_gib * 2**30) // per_block)

    @torch.inference_mode()
    def profile_run(self) -> int:
        """One forward at the largest batch the scheduler can form, through the paged-attention path:
        `max_num_batched_tokens` prompt tokens in sequences of at most `max_model_len`, with a
        temporary KV cache just big enough for them, plus logits for `max_num_seqs` rows.
        Returns the bytes of that temporary cache (the caller leaves them out of the activation peak)."""
        sched, bs = self.config.scheduler, self.block_size
        total = sched.max_num_batched_tokens
        longest = min(self.max_model_len, total)
        lens = [longest] * (total // longest) + ([total % longest] if total % longest else [])
        chunks, first_block = [], 0
        for n in lens:  # whole prompts, each in fresh consecutive blocks of the scratch cache
            table = list(range(first_block, first_block + (n + bs - 1) // bs))
            first_block += len(table)
            chunks.append(([0] * n, 0, n, table))
        ids, positions, meta = device_batch(flat_batch(chunks, bs), self.device)
        a = self.arch
        scratch = allocate_kv_cache(
            a.num_layers, first_block, bs, a.num_kv_heads, a.head_dim, self.kv_dtype, self.device
        )
        with set_forward_context(ForwardContext(meta, scratch)):
            hidden = self.forward(ids, positions)
        self.model.compute_logits(hidden[: min(total, sched.max_num_seqs)])
        return bytes_per_block(a.num_layers, bs, a.num_kv_heads, a.head_dim, self.kv_dtype) * first_block

    def _profile_cuda_blocks(self, per_block: int) -> int:
        """Blocks that fit in `gpu_memory_utilization` of the card after a forward at the largest batch."""
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
        blocks = int(budget // per_block)
        if blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB); "
                "raise --gpu-memory-utilization or lower --max-num-batched-tokens"
            )
        return blocks

    # -- one step ------------------------------------------------------------------------------------

    def host_batch(self, scheduled: list[ScheduledSeq]) -> dict[str, list]:
        chunks = [
            (item.seq.token_ids, item.seq.num_computed_tokens, item.seq.num_computed_tokens + item.num_new_tokens,
             item.seq.block_table)
            for item in scheduled
        ]  # fmt: skip
        return flat_batch(chunks, self.block_size)

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq]) -> PendingSample | None:
        """Queue this step's forward and sampling on the device; returns the sampled tokens on their
        way back (None when no chunk ends its tokens), without waiting for them.

        An input token still pending from the previous launch (async scheduling) is copied into the
        inputs on the device from that launch's sampled tokens. Sequences that asked for prompt
        logprobs get them in `self.prompt_logprobs` (seq_id -> list); computing those waits."""
        rows = [i for i, item in enumerate(scheduled) if item.samples]
        self.prompt_logprobs = {}
        b = self.host_batch(scheduled)
        feed = self._pending_feed(scheduled, b["starts"])
        if self.decode_graphs is not None and self._is_graph_decode(scheduled):
            logits = self.decode_graphs.replay(
                b["ids"], b["positions"], b["slots"], b["seq_lens"], b["tables"], feed=feed
            )  # fmt: skip
        else:
            if self.mixed_graphs is not None and self.mixed_graphs.fits(len(b["ids"]), len(scheduled)):
                hidden = self.mixed_graphs.replay(b, feed=feed)
            else:
                input_ids, positions, meta = device_batch(b, self.device)
                if feed is not None:
                    feed(input_ids)
                with set_forward_context(ForwardContext(meta, self.kv_caches)):
                    hidden = self.forward(input_ids, positions)
            starts = b["starts"]
            self._prompt_logprobs(scheduled, hidden, starts)
            if not rows:
                self._last_sampled = None
                return None
            last = to_device([starts[i + 1] - 1 for i in rows], torch.long, self.device)
            logits = self.model.compute_logits(hidden[last])
        seqs = [scheduled[i].seq for i in rows]
        # token histories are copied only for the rows that read them (penalties, min_tokens):
        # copying every row's prompt and output each step costs O(context) host time per sequence
        hist = [s.params.reads_history for s in seqs]
        batch = SamplingBatch(
            params=[s.params for s in seqs],
            prompt_token_ids=[s.prompt_token_ids if h else [] for s, h in zip(seqs, hist, strict=True)],
            output_token_ids=[s.output_token_ids if h else [] for s, h in zip(seqs, hist, strict=True)],
            generators=[s.generator for s in seqs],
        )
        sample = self.sampler.sample(logits, batch)
        self._last_sampled = (sample.token_ids, {s.seq_id: k for k, s in enumerate(seqs)})
        return sample

    def _pending_feed(self, scheduled: list[ScheduledSeq], starts: list[int]) -> Callable | None:
        """For inputs sampled by the last launch and not read back yet: a function that writes them
        into a device input-id buffer (flat batch order), from that launch's device tokens."""
        dst: list[int] = []
        src: list[int] = []
        rows = self._last_sampled[1] if self._last_sampled is not None else {}
        for i, item in enumerate(scheduled):
            seq = item.seq
            if not seq.num_pending:
                continue
            # one step of lookahead: the one pending token is the last launch's, at position num_tokens
            if seq.num_pending != 1 or seq.seq_id not in rows:
                raise RuntimeError(f"sequence {seq.seq_id}: pending tokens not from the last launch")
            dst.append(starts[i] + seq.num_tokens - seq.num_computed_tokens)
            src.append(rows[seq.seq_id])
        if not dst:
            return None
        tokens = self._last_sampled[0]
        dst_t = to_device(dst, torch.long, self.device)
        src_t = to_device(src, torch.long, self.device)

        def feed(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, dst_t, tokens.index_select(0, src_t))

        return feed

    def _prompt_logprobs(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor, starts: list[int]) -> None:
        """Logprob of each prompt token given the ones before it (the row at position p scores token p+1)."""
        for i, item in enumerate(scheduled):
            seq, top_n = item.seq, item.seq.params.prompt_logprobs
            begin = seq.num_computed_tokens
            end = min(begin + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if top_n is None or end <= begin:
                continue
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[starts[i] : starts[i] + end - begin]), -1)
            targets = torch.tensor(seq.token_ids[begin + 1 : end + 1], device=logprobs.device)
            chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
            top = logprobs.topk(top_n, dim=-1) if top_n > 0 else None
            out = []
            for j, tok in enumerate(targets.tolist()):
                entry = {tok: chosen[j]}
                if top is not None:
                    entry.update(zip(top.indices[j].tolist(), top.values[j].tolist(), strict=True))
                out.append(entry)
            self.prompt_logprobs[seq.seq_id] = out

    def _is_graph_decode(self, scheduled: list[ScheduledSeq]) -> bool:
        return len(scheduled) <= self.decode_graphs.max_size and all(
            item.num_new_tokens == 1 and item.samples for item in scheduled
        )

    def capture_graphs(self, max_model_len: int) -> None:
        """Full CUDA graphs (CUDA only, not with enforce_eager): mixed batches first (the larger
        graphs), then pure-decode batches, all in one memory pool."""
        sched, comp = self.config.scheduler, self.config.compile
        max_blocks = (max_model_len + self.block_size - 1) // self.block_size
        use_graphs = self.device.startswith("cuda")
        pool = None
        mixed = default_mixed_sizes(comp.cudagraph_mixed_max_tokens, sched.max_num_batched_tokens)
        if mixed:
            self.mixed_graphs = MixedGraphs(
                self.forward, self.kv_caches, mixed, sched.max_num_seqs, max_blocks, max_model_len, self.device,
                capture=use_graphs,
            )  # fmt: skip
            if use_graphs:
                self.mixed_graphs.capture()
                pool = self.mixed_graphs.pool
                self.timings["cudagraph_capture_mixed_s"] = self.mixed_graphs.capture_seconds
        # the same sizes the compile plan recorded (they are a cache-key factor)
        sizes = resolve_capture_sizes(comp.cudagraph_capture_sizes, sched.max_num_seqs, sched.max_num_batched_tokens)
        sizes = [s for s in sizes if s <= sched.max_num_seqs]
        self.decode_graphs = DecodeGraphs(
            self.forward, self.model.compute_logits, self.kv_caches, sizes, max_blocks, max_model_len, self.device,
            capture=use_graphs,
        )  # fmt: skip
        if use_graphs:
            self.decode_graphs.capture(pool)
            self.timings["cudagraph_capture_s"] = self.decode_graphs.capture_seconds


PENDING_TOKEN = -1  # an out-of-range id: a pending input the device feed missed fails loudly


def flat_batch(chunks: list[tuple[list[int], int, int, list[int]]], block_size: int) -> dict[str, list]:
    """The flat batch as host lists. Each chunk is (token ids, begin, end, block table): the tokens
    begin..end-1 of one sequence are computed this step, after the `begin` already in the cache."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens: list[int] = []
    for token_ids, begin, end, table in chunks:
        ids.extend(token_ids[begin:end])
        if end > len(token_ids):  # pending tokens (async scheduling): filled in on the device
            ids.extend([PENDING_TOKEN] * (end - max(begin, len(token_ids))))
        positions.extend(range(begin, end))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(begin, end))
        starts.append(starts[-1] + end - begin)
        seq_lens.append(end)
    tables = [table for *_, table in chunks]
    return dict(ids=ids, positions=positions, slots=slots, starts=starts, seq_lens=seq_lens, tables=tables)


def device_batch(b: dict[str, list], device: str) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Input ids, positions and attention metadata on `device` for a batch from flat_batch()."""
    width = max(len(t) for t in b["tables"])
    starts = b["starts"]
    meta = AttentionMetadata(
        slot_mapping=to_device(b["slots"], torch.long, device),
        query_start_loc=to_device(starts, torch.int32, device),
        seq_lens=to_device(b["seq_lens"], torch.int32, device),
        block_tables=to_device([t + [0] * (width - len(t)) for t in b["tables"]], torch.int32, device),
        query_start_loc_host=starts,
        seq_lens_host=b["seq_lens"],
        max_query_len=max(end - begin for begin, end in itertools.pairwise(starts)),
        max_seq_len=max(b["seq_lens"]),
        num_seqs=len(b["seq_lens"]),
    )
    input_ids = to_device(b["ids"], torch.long, device)
    positions = to_device(b["positions"], torch.long, device)
    return input_ids, positions, meta
