"""Full CUDA graphs for pure-decode batches, one per capture size, all in one memory pool.

A decode step is dozens of small kernels per layer; replaying a graph removes the launch gaps. The
attention metadata lives in static buffers that the graphs read, so a replay only needs the new
batch copied in. Batches are padded up to the next captured size: padded rows write no KV
(slot -1) and attend over one token of block 0, so they stay finite and are never read back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from atomc.runtime.forward_context import AttentionMetadata, ForwardContext, set_forward_context

log = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sizes: list[int],
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: str,
    ):
        self.forward, self.compute_logits, self.kv_caches = forward, compute_logits, kv_caches
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.max_seq_len = max_seq_len
        n, dev = self.max_size, device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        # pinned staging: one host->device copy per buffer per step, without a sync
        self.staging = {
            name: torch.empty_like(buf, device="cpu").pin_memory()
            for name, buf in self._buffers().items()
            if name != "query_start_loc"
        }
        # numpy views of the pinned buffers: filling them per step is plain memory writes
        self.staging_np = {name: buf.numpy() for name, buf in self.staging.items()}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "slot_mapping": self.slot_mapping,
            "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens,
            "block_tables": self.block_tables,
        }

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.max_seq_len,  # an upper bound: the kernel reads the real lengths
            num_seqs=bs,
        )

    def _run(self, bs: int) -> torch.Tensor:
        with set_forward_context(ForwardContext(self._metadata(bs), self.kv_caches)):
            hidden = self.forward(self.input_ids[:bs], self.positions[:bs])
        return self.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        for bs in sorted(self.sizes, reverse=True):  # largest first: smaller graphs reuse its pool
            self._run(bs)  # warm-up: kernels compile and allocators settle outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bs] = self._run(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d decode graphs in %.2f s", len(self.graphs), self.capture_seconds)

    def padded_size(self, bs: int) -> int | None:
        for size in self.sizes:
            if size >= bs:
                return size
        return None

    def replay(
        self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """Logits [bs, vocab] for a pure-decode batch of bs = len(input_ids) sequences."""
        bs = len(input_ids)
        size = self.padded_size(bs)
        width = max(len(t) for t in tables)
        st, st_np = self.staging, self.staging_np
        st_np["input_ids"][:bs] = input_ids
        st_np["positions"][:bs] = positions
        st_np["slot_mapping"][:size] = -1
        st_np["slot_mapping"][:bs] = slots
        st_np["seq_lens"][:size] = 1
        st_np["seq_lens"][:bs] = seq_lens
        bt = st_np["block_tables"]
        bt[:size, :width] = 0
        bt[:bs, :width] = [t + [0] * (width - len(t)) for t in tables]
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            getattr(self, name)[:size].copy_(st[name][:size], non_blocking=True)
        self.block_tables[:size, :width].copy_(st["block_tables"][:size, :width], non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:bs]
