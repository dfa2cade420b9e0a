"""Full CUDA graphs: one per pure-decode batch size, and one per token count for mixed batches.

A step is hundreds of small kernels; replaying a graph removes their launch cost. On the H200 the
compiled 8B forward takes about 22 ms of CPU time to launch whatever the batch, while a mixed step
of 64 decodes + a 128-token chunk needs far less GPU time than that (benchmarks/host_overhead.py),
so mixed steps are launch-bound unless they are captured too.

Both kinds read their inputs and attention metadata from static buffers, so a replay only copies the
new batch in (pinned staging, no sync) and launches one graph. All graphs share one memory pool,
captured largest first.

- `DecodeGraphs` (size = sequences = tokens): forward + logits. Padded rows write no KV (slot -1)
  and attend over one token of block 0, so they stay finite and are never read back.
- `MixedGraphs` (size = tokens, any mix of prefill chunks and decodes): forward only; the runner
  takes the rows it samples from the hidden states. The metadata always describes `max_seqs`
  sequences: the real ones, then empty ones (no query rows, no context), so the attention grid
  depends only on the captured size. Padded tokens belong to no sequence and write no KV; their
  rows are never read.

Full graphs rather than piecewise ones: with the attention metadata static, the attention kernel
needs no host values, so the whole forward fits in one graph and no op is left to launch eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from atomc.forward_context import AttentionMetadata, ForwardContext, set_forward_context

log = logging.getLogger(__name__)


def default_mixed_sizes(max_tokens: int, max_num_batched_tokens: int) -> list[int]:
    """Token counts captured for mixed batches: 16, 32, 64, 128, then every 128 up to 512, then
    every 256 up to `max_tokens` (0 = no mixed graphs)."""
    top = min(max_tokens, max_num_batched_tokens)
    ladder = [16, 32, 64, 128, 256, 384, 512] + list(range(768, top + 1, 256))
    return sorted({s for s in ladder if s <= top} | ({top} if top > 0 else set()))


class _StaticBatchGraphs:
    """Static inputs + metadata buffers, pinned staging, and one graph per size in one pool.

    With `capture=False` (CPU tests) a replay runs the same forward eagerly over the same static
    buffers, so the padding and buffer logic is testable without a GPU.
    """

    kind = "static"

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sizes: list[int],
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: str,
        capture: bool = True,
    ):
        self.forward, self.kv_caches = forward, kv_caches
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.max_seqs, self.max_seq_len = max_seqs, max_seq_len
        self.use_graphs = capture
        dev = device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=dev)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=dev)
        # pinned staging: one host->device copy per buffer per step, without a sync
        pin = torch.device(dev).type == "cuda"
        self.staging = {
            name: (lambda t: t.pin_memory() if pin else t)(torch.zeros_like(buf, device="cpu"))
            for name, buf in self._buffers().items()
        }
        # numpy views of the staging buffers: filling them per step is plain memory writes
        self.staging_np = {name: buf.numpy() for name, buf in self.staging.items()}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self._host_meta: tuple[list[int], list[int]] = ([], [])  # only the CPU reference path reads it
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
        }

    def _metadata(self, size: int) -> AttentionMetadata:
        raise NotImplementedError

    def _output(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def _run(self, size: int) -> torch.Tensor:
        with set_forward_context(ForwardContext(self._metadata(size), self.kv_caches)):
            hidden = self.forward(self.input_ids[:size], self.positions[:size])
        return self._output(hidden)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory; `pool` shares
        the pool of graphs captured before (the decode graphs)."""
        t0 = time.perf_counter()
        self.pool = pool
        for size in sorted(self.sizes, reverse=True):
            self._run(size)  # warm-up: kernels compile and allocators settle outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self._run(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d %s graphs in %.2f s", len(self.graphs), self.kind, self.capture_seconds)

    def padded_size(self, n: int) -> int | None:
        for size in self.sizes:
            if size >= n:
                return size
        return None

    def _wait_staging_free(self) -> None:
        if self._staging_read is not None:
            self._staging_read.synchronize()

    def _launch(self, size: int) -> torch.Tensor:
        if self._staging_read is not None:
            self._staging_read.record()  # after the copies, before the graph: they are all queued
        if self.use_graphs:
            self.graphs[size].replay()
            return self.outputs[size]
        with torch.inference_mode():
            return self._run(size)


class DecodeGraphs(_StaticBatchGraphs):
    """Forward + logits for pure-decode batches; size = number of sequences."""

    kind = "decode"

    def __init__(self, forward, compute_logits, kv_caches, sizes, max_blocks_per_seq, max_seq_len, device, **kw):
        n = max(sizes)
        super().__init__(forward, kv_caches, sizes, n, n, max_blocks_per_seq, max_seq_len, device, **kw)
        self.compute_logits = compute_logits
        self.query_start_loc.copy_(torch.arange(n + 1, dtype=torch.int32))  # one token each, never changes

    @property
    def logits(self) -> dict[int, torch.Tensor]:
        return self.outputs

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            query_start_loc_host=list(range(bs + 1)) if not self.use_graphs else [],
            seq_lens_host=self._host_meta[1] + [1] * (bs - len(self._host_meta[1])) if not self.use_graphs else [],
            max_query_len=1,
            max_seq_len=self.max_seq_len,  # an upper bound: the kernel reads the real lengths
            num_seqs=bs,
        )

    def _output(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)

    def replay(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        feed: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Logits [bs, vocab] for a pure-decode batch of bs = len(input_ids) sequences. `feed`
        writes input ids known only on the device into the input buffer after the copy in."""
        bs = len(input_ids)
        size = self.padded_size(bs)
        width = max(len(t) for t in tables)
        self._wait_staging_free()
        st_np = self.staging_np
        st_np["input_ids"][:bs] = input_ids
        st_np["positions"][:bs] = positions
        # padded rows get a valid id and position too: RoPE reads its table at every row's
        # position, and an id left by an earlier step may be a pending -1
        st_np["input_ids"][bs:size] = 0
        st_np["positions"][bs:size] = 0
        st_np["slot_mapping"][:size] = -1
        st_np["slot_mapping"][:bs] = slots
        st_np["seq_lens"][:size] = 1
        st_np["seq_lens"][:bs] = seq_lens
        bt = st_np["block_tables"]
        bt[:size, :width] = 0
        bt[:bs, :width] = [t + [0] * (width - len(t)) for t in tables]
        st = self.staging
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            getattr(self, name)[:size].copy_(st[name][:size], non_blocking=True)
        self.block_tables[:size, :width].copy_(st["block_tables"][:size, :width], non_blocking=True)
        if feed is not None:
            feed(self.input_ids)
        if not self.use_graphs:
            self._host_meta = ([], list(seq_lens))
        return self._launch(size)[:bs]


class MixedGraphs(_StaticBatchGraphs):
    """Forward only, for any batch of at most `max_size` tokens and `max_seqs` sequences."""

    kind = "mixed"

    def __init__(self, forward, kv_caches, sizes, max_seqs, max_blocks_per_seq, max_seq_len, device, **kw):
        super().__init__(forward, kv_caches, sizes, max(sizes), max_seqs, max_blocks_per_seq, max_seq_len, device, **kw)

    def _metadata(self, size: int) -> AttentionMetadata:
        starts, lens = self._host_meta  # empty under graphs: the Triton kernel reads the buffers
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc if self.use_graphs else self.query_start_loc[: len(starts)],
            seq_lens=self.seq_lens if self.use_graphs else self.seq_lens[: len(lens)],
            block_tables=self.block_tables if self.use_graphs else self.block_tables[: len(lens)],
            query_start_loc_host=starts,
            seq_lens_host=lens,
            max_query_len=2,  # > 1: the prefill tiling, which serves decode rows too
            max_seq_len=self.max_seq_len,
            num_seqs=self.max_seqs if self.use_graphs else len(lens),
        )

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.max_size and num_seqs <= self.max_seqs

    def replay(self, b: dict[str, list], feed: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for a batch from `flat_batch` (T = its token count); `feed`
        as for DecodeGraphs.replay."""
        t, n = len(b["ids"]), len(b["seq_lens"])
        size = self.padded_size(t)
        width = max(len(x) for x in b["tables"])
        self._wait_staging_free()
        st_np = self.staging_np
        st_np["input_ids"][:t] = b["ids"]
        st_np["input_ids"][t:size] = 0
        st_np["positions"][:t] = b["positions"]
        st_np["positions"][t:size] = 0
        st_np["slot_mapping"][:t] = b["slots"]
        st_np["slot_mapping"][t:size] = -1
        # the sequences after the real ones are empty: no query rows (start = end = t), no context
        st_np["query_start_loc"][: n + 1] = b["starts"]
        st_np["query_start_loc"][n + 1 :] = t
        st_np["seq_lens"][:n] = b["seq_lens"]
        st_np["seq_lens"][n:] = 0
        st_np["block_tables"][:n, :width] = [x + [0] * (width - len(x)) for x in b["tables"]]
        st = self.staging
        for name in ("input_ids", "positions", "slot_mapping"):
            getattr(self, name)[:size].copy_(st[name][:size], non_blocking=True)
        self.query_start_loc.copy_(st["query_start_loc"], non_blocking=True)
        self.seq_lens.copy_(st["seq_lens"], non_blocking=True)
        self.block_tables[:n, :width].copy_(st["block_tables"][:n, :width], non_blocking=True)
        if feed is not None:
            feed(self.input_ids)
        if not self.use_graphs:
            self._host_meta = (list(b["starts"]), list(b["seq_lens"]))
        return self._launch(size)[:t]
