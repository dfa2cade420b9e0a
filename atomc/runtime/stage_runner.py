"""StageRunner: the model runner of one pipeline stage (`--pipeline-parallel-size` > 1).

Each stage's process holds a contiguous run of decoder layers (models/layers/parallel.py:
`stage_layers`) and a KV cache for those layers only; every stage runs every step, in the order the
driver sent them (atomc/runtime/stage_io.py says what travels between them):

- stage 0 is the driver's runner: it embeds the step's ids (feeding pending inputs on its device,
  as a single runner does), runs its layers, sends the hidden states on, and returns at once; the
  step's logits come back from the last stage in the background, and the driver samples them when
  the engine reads the step's result (`PendingStep.result()`), so it can launch further steps
  meanwhile, and it is still the only rank that samples (sampling parameters, token histories,
  seeds and grammars stay on the driver);
- a later stage receives the previous stage's hidden states, runs its layers, and sends them on;
  the last one applies the final norm and sends the logits of the rows the driver needs.

With tensor parallelism inside the stages (`-tp T -pp P`) each stage is T processes running the
same steps, their collectives on the stage's own "tp" group (atomc/runtime/distributed.py). After
each layer's all-reduce every one of them holds the whole hidden state, so tensor-parallel rank t of
stage s sends it to rank t of stage s + 1 (atomc/runtime/stage_io.py says why 1:1); the last
stage's ranks all run the vocab-parallel LM head (its all-gather is theirs), and its rank 0 sends
the logits to the driver, which is stage 0's rank 0.

Each stage runs its own compiled artifact (atomc/graphs/trace.py: a stage after the first is traced
from hidden states), or the eager model with --enforce-eager. On CUDA it replays its own CUDA graphs
(atomc/runtime/stage_graphs.py), the received hidden states landing in the graphs' static input;
steps no captured size holds run the forward directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from atomc.forward_context import group_context, set_forward_context
from atomc.runtime.batch import StepInput
from atomc.runtime.capture_sizes import decode_graph_sizes
from atomc.runtime.cudagraph import default_mixed_sizes
from atomc.runtime.model_runner import (
    ModelRunner,
    PendingStep,
    captures_cuda_graphs,
    device_batch,
)
from atomc.runtime.sampler import PendingSample, SamplerOutput, prompt_logprob_entries
from atomc.runtime.stage_graphs import StageGraphs
from atomc.runtime.stage_io import PendingLogits, Sends, logits_rows, recv_hidden, recv_into
from atomc.runtime.transfer import to_device
from models.layers.parallel import ParallelInfo


class StageRunner(ModelRunner):
    """A ModelRunner over one pipeline stage's layers (or one tensor-parallel shard of them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sends = Sends()
        self.hidden_size = self.model.config.hidden_size
        self.vocab_size = self.arch.vocab_size
        self.stage_graphs: StageGraphs | None = None  # capture_graphs (CUDA, not --enforce-eager)

    @torch.inference_mode()
    def launch(self, step: StepInput) -> PendingStep | None:
        info = self.parallel
        feed = None
        if info.first_stage:
            if step.finished_seq_ids and self._generators:
                for seq_id in step.finished_seq_ids:
                    self._generators.pop(seq_id, None)
            feed = self._pending_feed(step)
        replay = self.stage_graphs.replayer(step) if self.stage_graphs is not None else None
        if replay is None:
            hidden = self._forward_step(step, feed)
        else:
            if not info.first_stage:  # into the graphs' static input, in step order as every receive
                recv_into(self.stage_graphs.hidden_rows(step.num_tokens), info.world_rank(info.stage - 1))
            hidden = replay(feed)
            if not info.last_stage and self.stage_graphs.captured:
                hidden = hidden.clone()  # the next replay overwrites the graph's output under the send
        rows = logits_rows(step)
        if not info.last_stage:  # to this tensor-parallel rank's peer in the next stage
            self.sends.send(hidden, info.world_rank(info.stage + 1))
        elif rows:
            # every tensor-parallel rank runs the LM head (its all-gather is a collective of the
            # stage); the stage's rank 0 alone sends the gathered logits to the driver
            logits = self.model.compute_logits(hidden[to_device(rows, torch.long, self.device)])
            if info.rank == 0:
                self.sends.send(logits, 0)
        if not info.first_stage or info.rank > 0:  # the driver alone samples
            return None
        return self._driver_result(step, len(rows), info)

    def _forward_step(self, step: StepInput, feed: Callable | None) -> torch.Tensor:
        """The step's forward without graphs: from the step's ids on the first stage, from the
        previous stage's hidden states (received here) on the others."""
        info = self.parallel
        input_ids, positions, metas = device_batch(step, self.device)
        hidden = None
        if feed is not None:
            feed(input_ids)
        if not info.first_stage:
            src = info.world_rank(info.stage - 1)
            hidden = recv_hidden(step.num_tokens, self.hidden_size, self.dtype, self.device, src)
        if len(metas) != len(self.kv_groups):
            raise RuntimeError(f"step {step.step_id}: {len(metas)} KV groups, the model {len(self.kv_groups)}")
        with set_forward_context(group_context(metas, self.kv_caches, self.layer_group, self.kv_scales)):
            return self.forward(input_ids, positions, hidden)

    def _driver_result(self, step: StepInput, num_rows: int, info: ParallelInfo) -> PendingStep | None:
        """Stage 0: the step's result, sampled from the last stage's logits once they arrive."""
        # no feed may read this step's tokens: they are sampled only when its result is read
        self._last_sampled = None
        if not num_rows:
            return None
        logits = PendingLogits(num_rows, self.vocab_size, self.device, info.world_rank(info.stages - 1, 0))
        n = len(step.sample_rows)
        prompt_logprobs = {}
        if step.prompt_logprobs:  # the engine keeps them at launch: this step waits for its logits
            prompt_logprobs = self._prompt_logprobs_of(step, logits.wait()[n:])
        if not n:
            return PendingStep(None, prompt_logprobs)
        batch = self._sampling_batch(step)

        def sample(bitmask: torch.Tensor | None = None) -> PendingSample:
            return self._sample(step.step_id, logits.wait()[:n], batch, step.masked_rows, bitmask)

        if step.masked_rows:  # structured outputs: the engine's bitmask first, then the sampling
            return PendingStep(None, prompt_logprobs, lambda bitmask: DeferredSample(lambda: sample(bitmask)))
        return PendingStep(DeferredSample(sample), prompt_logprobs)

    @staticmethod
    def _prompt_logprobs_of(step: StepInput, logits: torch.Tensor) -> dict[int, list[dict[int, float]]]:
        out, at = {}, 0
        for req in step.prompt_logprobs:
            out[req.seq_id] = prompt_logprob_entries(req, logits[at : at + len(req.target_ids)])
            at += len(req.target_ids)
        return out

    def _profile_forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # a stage after the first starts from hidden states: zeros of the profiled batch's shape
        hidden = None
        if not self.parallel.first_stage:
            hidden = torch.zeros(ids.numel(), self.hidden_size, dtype=self.dtype, device=self.device)
        return self.forward(ids, positions, hidden)

    def capture_graphs(self, max_model_len: int) -> None:
        """This stage's CUDA graphs (CUDA only, not with enforce_eager), at the single runner's
        sizes: mixed batches, then pure-decode batches, in one memory pool. Not yet run on a GPU."""
        sched, comp = self.config.scheduler, self.config.compile
        self.stage_graphs = self.build_graphs(
            decode_graph_sizes(comp.cudagraph_capture_sizes, sched.max_num_seqs, sched.max_num_batched_tokens),
            default_mixed_sizes(comp.cudagraph_mixed_max_tokens, sched.max_num_batched_tokens),
            max_model_len,
            capture=captures_cuda_graphs(self.device, self.model),
        )
        if self.stage_graphs.use_graphs:
            self.timings["cudagraph_capture_s"] = self.stage_graphs.capture()

    def build_graphs(
        self, decode_sizes: list[int], mixed_sizes: list[int], max_model_len: int, capture: bool
    ) -> StageGraphs:
        """The stage's graphs over its forward and KV cache, not captured yet (`capture=False`: a
        replay runs the forward over the same static buffers, as on a CPU)."""
        hidden = None if self.parallel.first_stage else (self.hidden_size, self.dtype)
        return StageGraphs(
            self.forward, self.kv_caches, decode_sizes, mixed_sizes, self.config.scheduler.max_num_seqs,
            (max_model_len + self.block_size - 1) // self.block_size, max_model_len, self.device, hidden,
            capture=capture, layer_group=self.layer_group, kv_scales=self.kv_scales,
        )  # fmt: skip


class DeferredSample:
    """A step's sampling, run when its result is first asked for (the logits arrive from the last
    stage in the background until then)."""

    def __init__(self, sample: Callable[[], PendingSample]):
        self._sample = sample
        self._pending: PendingSample | None = None

    def result(self) -> SamplerOutput:
        if self._pending is None:
            self._pending = self._sample()
        return self._pending.result()


def runner_class(info: ParallelInfo) -> type[ModelRunner]:
    """The runner of a process holding `info`: a stage's or the whole model's (or its TP shard)."""
    return StageRunner if info.stages > 1 else ModelRunner
