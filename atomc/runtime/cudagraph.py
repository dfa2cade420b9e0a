"""Full CUDA graphs: one per (sequences, query tokens per sequence) for uniform decode-like
batches, and one per token count for mixed batches.

A step is hundreds of small kernels; replaying a graph removes their launch cost. The compiled
forward of a large model takes more CPU time to launch than a decode step or a mixed step with a
short chunk needs on the GPU (docs/performance.md, benchmarks/host_overhead.py), so such steps are
launch-bound unless they are captured.

Both kinds read their inputs and attention metadata from static buffers, so a replay only copies the
new batch in (pinned staging, no sync) and launches one graph. All graphs share one memory pool,
captured largest first.

- `DecodeGraphs`, keyed by (sequences, query tokens per sequence): forward + logits of every row,
  for steps where every sequence has the same query length q and every row is sampled: q = 1 is
  plain decode; q = k + 1 is a speculative verify step. Padded sequences have q rows that write no
  KV (slot -1) and attend over q tokens of block 0, so they stay finite and are never read back.
- `MixedGraphs` (size = tokens, any mix of prefill chunks and decodes): forward only; the runner
  takes the rows it samples from the hidden states. The metadata always describes `max_seqs`
  sequences: the real ones, then empty ones (no query rows, no context), so the attention grid
  depends only on the captured size. Padded tokens belong to no sequence and write no KV; their
  rows are never read.

With several KV-cache groups (sliding-window layers beside full ones, each group its own block
pool) the buffers hold a slot mapping and a block table per group, and each layer's attention
reads its group's (`layer_group`).

Full graphs rather than piecewise ones: with the attention metadata static, the attention kernel
needs no host values, so the whole forward fits in one graph and no op is left to launch eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Hashable

import torch

from atomc.forward_context import AttentionMetadata, group_context, set_forward_context
from atomc.progress import progress_bar
from atomc.runtime.batch import StepInput, group_array_name, write_batch_arrays

log = logging.getLogger(__name__)


def default_mixed_sizes(max_tokens: int, max_num_batched_tokens: int) -> list[int]:
    """Token counts captured for mixed batches: 16, 32, 64, 128, then every 128 up to 512, then
    every 256 up to `max_tokens` (0 = no mixed graphs)."""
    top = min(max_tokens, max_num_batched_tokens)
    ladder = [16, 32, 64, 128, 256, 384, 512] + list(range(768, top + 1, 256))
    return sorted({s for s in ladder if s <= top} | ({top} if top > 0 else set()))


class _StaticBatchGraphs:
    """Static inputs + metadata buffers, pinned staging, and one graph per key in one pool.

    With `capture=False` (CPU tests) a replay runs the same forward eagerly over the same static
    buffers, so the padding and buffer logic is testable without a GPU.
    """

    kind = "static"

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        keys: list[Hashable],
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: str,
        capture: bool = True,
        layer_group: list[int] | None = None,
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ):
        """`layer_group[l]`: layer l's KV-cache group (None: one group). `kv_scales`: per layer
        (k_scale, v_scale) of FP8 pages (None: not FP8); the graphs read these very tensors."""
        self.forward, self.kv_caches, self.kv_scales = forward, kv_caches, kv_scales
        self.layer_group = layer_group or [0] * len(kv_caches)
        self.num_groups = max(self.layer_group, default=0) + 1
        self.keys = keys
        self.max_seqs, self.max_seq_len = max_seqs, max_seq_len
        self.use_graphs = capture
        dev = device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=dev)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=dev)
        # the KV groups after the first: their own slots and block tables (the same shapes)
        self.group_buffers: dict[str, torch.Tensor] = {}
        for g in range(1, self.num_groups):
            self.group_buffers[group_array_name("slot_mapping", g)] = torch.full_like(self.slot_mapping, -1)
            self.group_buffers[group_array_name("block_tables", g)] = torch.zeros_like(self.block_tables)
        # pinned staging: one host->device copy per buffer per step, without a sync
        pin = torch.device(dev).type == "cuda"
        self.staging = {
            name: (lambda t: t.pin_memory() if pin else t)(torch.zeros_like(buf, device="cpu"))
            for name, buf in self._buffers().items()
        }
        # numpy views of the staging buffers: filling them per step is plain memory writes
        self.staging_np = {name: buf.numpy() for name, buf in self.staging.items()}
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Hashable, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0
        # the staging buffers may be rewritten only once the GPU has read them: a step that samples
        # nothing never syncs, so the next step could otherwise overwrite a copy still in the queue
        self._staging_read = torch.cuda.Event() if pin else None

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "slot_mapping": self.slot_mapping,
            "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens,
            "block_tables": self.block_tables,
            **self.group_buffers,
        }

    def _group_metadata(self, meta: AttentionMetadata, num_tokens: int, num_seqs: int) -> list[AttentionMetadata]:
        """Per KV group, `meta` with the group's slots and block tables."""
        metas = [meta]
        for g in range(1, self.num_groups):
            slots = self.group_buffers[group_array_name("slot_mapping", g)][:num_tokens]
            tables = self.group_buffers[group_array_name("block_tables", g)][:num_seqs]
            metas.append(dataclasses.replace(meta, slot_mapping=slots, block_tables=tables))
        return metas

    def _copy_in_groups(self, num_tokens: int, num_seqs: int, width: int) -> None:
        st = self.staging
        for g in range(1, self.num_groups):
            slots, tables = group_array_name("slot_mapping", g), group_array_name("block_tables", g)
            self.group_buffers[slots][:num_tokens].copy_(st[slots][:num_tokens], non_blocking=True)
            self.group_buffers[tables][:num_seqs, :width].copy_(st[tables][:num_seqs, :width], non_blocking=True)

    def num_tokens(self, key: Hashable) -> int:
        raise NotImplementedError

    def _metadata(self, key: Hashable) -> list[AttentionMetadata]:
        """The attention metadata of each KV group for graph `key`, over the static buffers."""
        raise NotImplementedError

    def _host_lists(self, num_seqs: int, query_start: torch.Tensor) -> tuple[list[int], list[int]]:
        """Host copies of the metadata for the torch reference path (no graphs: CPU tests only)."""
        if self.use_graphs:
            return [], []  # the Triton kernel reads the buffers
        return query_start[: num_seqs + 1].tolist(), self.seq_lens[:num_seqs].tolist()

    def _output(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def _run(self, key: Hashable) -> torch.Tensor:
        n = self.num_tokens(key)
        ctx = group_context(self._metadata(key), self.kv_caches, self.layer_group, self.kv_scales)
        with set_forward_context(ctx):
            hidden = self.forward(self.input_ids[:n], self.positions[:n])
        return self._output(hidden)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every key, largest first so the smaller graphs reuse its memory; `pool` shares
        the pool of graphs captured before (the decode graphs)."""
        t0 = time.perf_counter()
        self.pool = pool
        bar = progress_bar(len(self.keys), f"{self.kind} graphs", "graph")
        for key in sorted(self.keys, key=self.num_tokens, reverse=True):
            bar.update(1)
            self._run(key)  # warm-up: kernels compile and allocators settle outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[key] = self._run(key)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        bar.close()
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d %s graphs in %.2f s", len(self.graphs), self.kind, self.capture_seconds)

    def _stage(self, step: StepInput, num_tokens: int, num_seqs: int, pad_query_len: int, query_start: bool) -> int:
        """Write the step into the staging buffers (after the GPU has read the previous ones)."""
        if self._staging_read is not None:
            self._staging_read.synchronize()
        return write_batch_arrays(step, self.staging_np, num_tokens, num_seqs, pad_query_len, query_start)

    def _copy_in(self, names: tuple[str, ...], n: int) -> None:
        st = self.staging
        for name in names:
            getattr(self, name)[:n].copy_(st[name][:n], non_blocking=True)

    def _launch(self, key: Hashable) -> torch.Tensor:
        if self._staging_read is not None:
            self._staging_read.record()  # after the copies, before the graph: they are all queued
        if self.use_graphs:
            self.graphs[key].replay()
            return self.outputs[key]
        with torch.inference_mode():
            return self._run(key)


class DecodeGraphs(_StaticBatchGraphs):
    """Forward + logits of every row for batches of `bs` sequences with `q` query tokens each;
    one graph per (bs, q) with bs in `sizes` and q in `query_lens`."""

    kind = "decode"

    def __init__(
        self, forward, compute_logits, kv_caches, sizes, max_blocks_per_seq, max_seq_len, device,
        query_lens: tuple[int, ...] = (1,), **kw,
    ):  # fmt: skip
        self.sizes, self.query_lens = sorted(sizes), sorted(query_lens)
        self.max_size = self.sizes[-1]
        n, q = self.max_size, self.query_lens[-1]
        keys = [(bs, ql) for bs in self.sizes for ql in self.query_lens]
        super().__init__(forward, kv_caches, keys, n * q, n, max_blocks_per_seq, max_seq_len, device, **kw)
        self.compute_logits = compute_logits
        # the query starts of (bs, q) are the first bs + 1 of 0, q, 2q, ...: one constant buffer per q
        self.query_starts = {
            ql: torch.arange(0, n * ql + 1, ql, dtype=torch.int32, device=device) for ql in self.query_lens
        }

    @property
    def logits(self) -> dict[tuple[int, int], torch.Tensor]:
        return self.outputs

    def num_tokens(self, key: tuple[int, int]) -> int:
        return key[0] * key[1]

    def key_for(self, num_seqs: int, query_len: int | None) -> tuple[int, int] | None:
        """The graph a batch of `num_seqs` sequences of `query_len` rows each pads up to, or None."""
        if query_len not in self.query_starts:
            return None
        for size in self.sizes:
            if size >= num_seqs:
                return size, query_len
        return None

    def _metadata(self, key: tuple[int, int]) -> list[AttentionMetadata]:
        bs, q = key
        starts, lens = self._host_lists(bs, self.query_starts[q])
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[: bs * q],
            query_start_loc=self.query_starts[q][: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            query_start_loc_host=starts,
            seq_lens_host=lens,
            max_query_len=q,
            max_seq_len=self.max_seq_len,  # an upper bound: the kernel reads the real lengths
            num_seqs=bs,
        )
        return self._group_metadata(meta, bs * q, bs)

    def _output(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)

    def replay(
        self, step: StepInput, key: tuple[int, int], feed: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """Logits [T, vocab] of every row of `step` (T = its token count), from the graph `key`
        (see key_for). `feed` writes input ids known only on the device into the input buffer
        after the copy in."""
        bs, q = key
        width = self._stage(step, bs * q, bs, q, query_start=False)
        self._copy_in(("input_ids", "positions", "slot_mapping"), bs * q)
        self._copy_in(("seq_lens",), bs)
        self.block_tables[:bs, :width].copy_(self.staging["block_tables"][:bs, :width], non_blocking=True)
        if self.num_groups > 1:
            self._copy_in_groups(bs * q, bs, width)
        if feed is not None:
            feed(self.input_ids)
        return self._launch(key)[: step.num_tokens]


class MixedGraphs(_StaticBatchGraphs):
    """Forward only, for any batch of at most `max_size` tokens and `max_seqs` sequences."""

    kind = "mixed"

    def __init__(self, forward, kv_caches, sizes, max_seqs, max_blocks_per_seq, max_seq_len, device, **kw):
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        super().__init__(
            forward, kv_caches, self.sizes, self.max_size, max_seqs, max_blocks_per_seq, max_seq_len, device, **kw
        )

    def num_tokens(self, key: int) -> int:
        return key

    def padded_size(self, n: int) -> int | None:
        for size in self.sizes:
            if size >= n:
                return size
        return None

    def _metadata(self, size: int) -> list[AttentionMetadata]:
        starts, lens = self._host_lists(self.max_seqs, self.query_start_loc)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            query_start_loc_host=starts,
            seq_lens_host=lens,
            max_query_len=2,  # > 1: the prefill tiling, which serves decode rows too
            max_seq_len=self.max_seq_len,
            num_seqs=self.max_seqs,
        )
        return self._group_metadata(meta, size, self.max_seqs)

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.max_size and num_seqs <= self.max_seqs

    def replay(self, step: StepInput, feed: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for `step` (T = its token count); `feed` as for DecodeGraphs.replay.
        The sequences after the real ones are empty: no query rows, no context."""
        t, n = step.num_tokens, step.num_seqs
        size = self.padded_size(t)
        width = self._stage(step, size, self.max_seqs, 0, query_start=True)
        self._copy_in(("input_ids", "positions", "slot_mapping"), size)
        self.query_start_loc.copy_(self.staging["query_start_loc"], non_blocking=True)
        self.seq_lens.copy_(self.staging["seq_lens"], non_blocking=True)
        self.block_tables[:n, :width].copy_(self.staging["block_tables"][:n, :width], non_blocking=True)
        if self.num_groups > 1:
            self._copy_in_groups(size, n, width)
        if feed is not None:
            feed(self.input_ids)
        return self._launch(size)[:t]
