"""What passes between pipeline stages each step: hidden states forward, the last stage's logits back.

Stage s sends the hidden states its layers produced, [T, hidden] in the model's dtype, to
stage s + 1; the last stage computes the logits of the rows the driver needs (`logits_rows`: the
sampled rows, then each prompt-logprob request's rows) and sends them, float32 [rows, vocab], to
stage 0, the driver, which samples. Each receiver knows the shapes from the step record, so nothing
but the tensors travel. Point-to-point on the world group (NCCL on CUDA, gloo on CPU), in step
order between each pair of ranks: every stage runs the steps in the order the driver sent them.

With tensor parallelism inside the stages (tp_size ranks a stage) each of a stage's ranks holds the
whole hidden state after its layers' all-reduces, and rank t of stage s sends it to rank t of stage
s + 1 (world ranks stage * tp_size + t): tp_size copies of the same tensor cross, one per pair,
instead of one send followed by a broadcast inside the next stage. The pairs are independent (across
machines, on a GPU cluster's one network card per GPU they travel side by side), and the receiving
stage needs no extra collective before its first layer. Only rank 0 of the last stage sends the
logits back.

Sends are asynchronous (`Sends`): a stage goes on to its next step while its output travels, and
the tensor is kept alive until its send completes. The decoder layers carry their residual inside
the hidden states (`x + f(x)`), so one tensor is the whole state between two stages.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from atomc.runtime.batch import StepInput


def logits_rows(step: StepInput) -> list[int]:
    """The rows whose logits the last stage sends back: the sampled rows, then every row of each
    prompt-logprob request in request order (both sides read the same record)."""
    rows = list(step.sample_rows)
    for req in step.prompt_logprobs:
        rows.extend(range(req.first_row, req.first_row + len(req.target_ids)))
    return rows


class Sends:
    """Asynchronous sends in flight, each tensor held until its send completes (a completed send's
    error is raised at the next `send` or `flush`)."""

    def __init__(self) -> None:
        self._works: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def send(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
        tensor = tensor.contiguous()
        self._works.append((dist.isend(tensor, dst, group=group), tensor))
        while self._works and self._works[0][0].is_completed():
            self._works.popleft()[0].wait()

    def flush(self) -> None:
        while self._works:
            self._works.popleft()[0].wait()


def recv_hidden(num_tokens: int, hidden_size: int, dtype: torch.dtype, device: str, src: int) -> torch.Tensor:
    """The previous stage's hidden states of a step of `num_tokens` rows (waits for them)."""
    return recv_into(torch.empty(num_tokens, hidden_size, dtype=dtype, device=device), src)


def recv_into(buf: torch.Tensor, src: int) -> torch.Tensor:
    """The previous stage's hidden states of a step, received into `buf` (a CUDA graph's static
    input: [T, hidden], contiguous); on CUDA the device waits for them, not the host."""
    dist.recv(buf, src)
    return buf


class PendingLogits:
    """The last stage's logits of one step, received in the background from the moment the driver
    launches the step; `wait()` returns them."""

    def __init__(self, rows: int, vocab: int, device: str, src: int):
        self._buf = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self._work: dist.Work | None = dist.irecv(self._buf, src)

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._buf
