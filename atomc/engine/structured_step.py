"""The engine's side of structured outputs: matchers for new sequences, the bitmask of each step.

How constrained rows fit async scheduling. A constrained row's mask for step N+1 needs the token
step N sampled for it, which is still on the device when N+1 is launched. The engine does not wait
for it before launching: `ModelRunner.launch` queues N+1's forward and returns it unsampled when the
step has constrained rows (`PendingStep.needs_bitmask`). The engine then reads step N back as it
always does (that wait is for N's sampling, queued before N+1's forward, so it does not wait for
N+1), each constrained sequence's matcher takes its token, and `finish_sampling` fills the bitmask
on the host and queues N+1's masking and sampling, all while the device runs N+1's forward. The
unconstrained rows of a mixed step are sampled in the same call, a little later than they would
be alone but with no sync of their own; a step without constrained rows takes none of this path
(`StepInput.masked_rows` is empty and the runner samples at once).

Compiling: an in-process engine compiles at `add_request` (its server compiled the constraint in
the request path already, so this is a cache hit; an offline caller gets a bad constraint as a
ValueError). An engine process compiles on one background thread (the first constraint also imports
xgrammar and loads transformers' tokenizer, seconds that must not stall the engine loop); its
requests wait outside the scheduler until their grammar is built.
"""

from __future__ import annotations

import concurrent.futures
import logging

import torch

from atomc.engine.sequence import Sequence
from atomc.engine.structured_outputs import GrammarCompiler, SequenceGrammar, fill_bitmask

log = logging.getLogger(__name__)


class StructuredSteps:
    def __init__(self, grammars: GrammarCompiler, device: str, compile_on_thread: bool = False):
        self.grammars = grammars
        self._pin = str(device).startswith("cuda")
        self._compile_on_thread = compile_on_thread
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiling: dict[str, tuple[concurrent.futures.Future, list[Sequence]]] = {}
        self._bitmask: torch.Tensor | None = None  # reused host buffer (pinned on CUDA)
        self.num_rejected = 0  # sampled tokens a grammar refused (the sampler's fallback)

    # -- new requests --------------------------------------------------------------------------------

    def prepare(self, request_id: str, seqs: list[Sequence]) -> bool:
        """Give `seqs` their matchers; True when done, False when their grammar is being compiled
        on the thread (`take_compiled` reports it). GrammarError when an in-process compile fails."""
        so = seqs[0].params.structured_outputs
        compiled = self.grammars.cached(so)
        if compiled is None and not self._compile_on_thread:
            compiled = self.grammars.compile(so)
        if compiled is not None:
            self._attach(compiled, seqs)
            return True
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="atomc-grammar")
        self._compiling[request_id] = (self._pool.submit(self.grammars.compile, so), seqs)
        return False

    @staticmethod
    def _attach(compiled, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.grammar = SequenceGrammar(compiled, seq.params.eos_token_ids)

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    def take_compiled(self) -> list[tuple[str, BaseException | None]]:
        """(request id, error or None) of each compile that finished; the successful ones' sequences
        have their matchers."""
        done = []
        for request_id, (future, seqs) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception()
            if error is None:
                self._attach(future.result(), seqs)
            done.append((request_id, error))
        return done

    def wait_compiled(self, timeout: float) -> None:
        futures = [f for f, _ in self._compiling.values()]
        concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    # -- each step -----------------------------------------------------------------------------------

    def accept(self, seq: Sequence, token: int) -> bool:
        """The sequence's matcher takes its new token (already appended); False if it refuses it."""
        grammar: SequenceGrammar = seq.grammar
        if grammar.num_accepted != len(seq.token_ids) - seq.num_prompt_tokens - 1:
            ok = grammar.sync(seq.output_token_ids)  # out of step (never expected): catch up from the ids
        else:
            ok = grammar.accept(token)
        if not ok:
            self.num_rejected += 1
            log.warning("sequence %d: token %d is outside its grammar; the sequence ends", seq.seq_id, token)
        return ok

    def finish_sampling(self, pending, samplers: list[Sequence], rows: list[int]) -> None:
        """Fill the bitmask of a launched step's constrained rows (`rows`, indices into its sampled
        sequences `samplers`) and queue their masking and the step's sampling (module docstring)."""
        grammars = [None if samplers[k].finished else samplers[k].grammar for k in rows]
        bitmask = self._buffer(len(samplers))
        fill_bitmask(grammars, bitmask, rows)
        pending.finish_sampling(bitmask)

    def _buffer(self, rows: int) -> torch.Tensor:
        """Host rows for the bitmask, one per sampled row of the step: one buffer, grown when
        needed. Reusing it is safe: before it is filled again the engine has read back the step that
        copied it (the copy came first)."""
        width = self.grammars.bitmask_width()
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = torch.empty((max(rows, 64), width), dtype=torch.int32, pin_memory=self._pin)
        return self._bitmask[:rows]
