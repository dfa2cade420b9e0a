"""CUDA graphs of one pipeline stage: its forward over static buffers, its hidden-state input included.

A single runner's graphs (atomc/runtime/cudagraph.py) start from token ids. A stage after the first
starts from the previous stage's hidden states, so they get a static buffer as well (`hidden_in`,
[largest captured batch, hidden]): each step's receive lands in its first T rows (`hidden_rows`),
and a graph reads the rows of its padded size. Padded rows hold what the buffer last held (zeros,
or an earlier step's hidden states: finite either way); they write no KV and are never read back,
as the padded ids of the single runner's graphs.

The keys are the single runner's: decode graphs per number of sequences (one query token each),
mixed graphs per token count. Every graph returns hidden states only, the decode ones included: a
stage before the last sends them on, and the last stage computes the logits of the rows the driver
needs outside the graph (the single runner's logits-in-graph shortcut needs every row sampled).

A graph's output is a static buffer that the next replay overwrites, while the send of it to the
next stage may still be in flight: the runner sends a copy (`StageRunner.launch`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from atomc.runtime.batch import StepInput
from atomc.runtime.cudagraph import DecodeGraphs, MixedGraphs


class StageDecodeGraphs(DecodeGraphs):
    """DecodeGraphs whose output is the stage's hidden states, not logits."""

    kind = "stage decode"

    def __init__(self, forward, kv_caches, sizes, max_blocks_per_seq, max_seq_len, device, **kw):
        super().__init__(forward, None, kv_caches, sizes, max_blocks_per_seq, max_seq_len, device, **kw)

    def _output(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class StageGraphs:
    """A stage's decode and mixed graphs, and the static hidden-state input of a stage after the
    first (`hidden`: its (hidden_size, dtype); None for the first stage, which starts from ids).

    With `capture=False` (CPU tests) a replay runs the same forward eagerly over the same buffers."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        kv_caches: list,
        decode_sizes: list[int],
        mixed_sizes: list[int],
        max_seqs: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: str,
        hidden: tuple[int, torch.dtype] | None,
        capture: bool = True,
        layer_group: list[int] | None = None,
        kv_scales: list | None = None,
    ):
        self.captured = False
        self.use_graphs = capture
        self.hidden_in: torch.Tensor | None = None
        if hidden is not None:
            rows = max([*decode_sizes, *mixed_sizes])
            self.hidden_in = torch.zeros(rows, hidden[0], dtype=hidden[1], device=device)
            forward = self._reading_hidden(forward, self.hidden_in)
        kw = dict(capture=capture, layer_group=layer_group, kv_scales=kv_scales)
        self.mixed = None
        if mixed_sizes:
            self.mixed = MixedGraphs(
                forward, kv_caches, mixed_sizes, max_seqs, max_blocks_per_seq, max_seq_len, device, **kw
            )
        self.decode = StageDecodeGraphs(forward, kv_caches, decode_sizes, max_blocks_per_seq, max_seq_len, device, **kw)

    @staticmethod
    def _reading_hidden(forward: Callable[..., torch.Tensor], buf: torch.Tensor) -> Callable[..., torch.Tensor]:
        # the graphs call forward(ids, positions) over their static buffers: the hidden states are
        # the first rows of `buf`, as many as the graph's tokens (a view: the graph reads `buf` itself)
        def read(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return forward(input_ids, positions, buf[: input_ids.shape[0]])

        return read

    def capture(self) -> float:
        """Capture every graph: the mixed ones first (larger), then decode, in one memory pool.
        Returns the seconds it took."""
        pool, seconds = None, 0.0
        if self.mixed is not None:
            self.mixed.capture()
            pool, seconds = self.mixed.pool, self.mixed.capture_seconds
        self.decode.capture(pool)
        self.captured = True
        return seconds + self.decode.capture_seconds

    def hidden_rows(self, num_tokens: int) -> torch.Tensor:
        """Where a step's received hidden states go: the first `num_tokens` rows of the static input."""
        if self.hidden_in is None:
            raise RuntimeError("the first pipeline stage starts from token ids: it has no hidden-state input")
        return self.hidden_in[:num_tokens]

    def replayer(self, step: StepInput) -> Callable[[Callable | None], torch.Tensor] | None:
        """The graph that runs `step` (called with the step's pending feed, it returns the hidden
        states [T, hidden]), or None when no captured size holds it (the eager forward then)."""
        key = self.decode.key_for(step.num_seqs, step.uniform_query_len())
        if key is not None:
            return lambda feed: self.decode.replay(step, key, feed=feed)
        if self.mixed is not None and self.mixed.fits(step.num_tokens, step.num_seqs):
            return lambda feed: self.mixed.replay(step, feed=feed)
        return None
