"""LLMEngine: requests in, RequestOutputs out, one scheduler step at a time.

engine -> scheduler (which sequences, how many tokens) -> model runner (forward + sample) ->
engine (append tokens, stop checks, detokenize, free finished sequences). Not thread-safe: the
server drives it from one engine thread.

A step that raises fails only its own requests (`_fail_step`): the requests whose sequences were in
the batch end with `RequestOutput.error` set and their KV blocks freed, and the engine keeps serving
the others. Only `MAX_FAILED_STEPS` failures in a row (a broken device, not one bad request) escape
`step()`, and then the server treats the engine as dead.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from atomc.config import EngineConfig
from atomc.engine.client import EngineClient
from atomc.engine.detokenizer import DetokenizerState, decode_rest, decode_step
from atomc.engine.generation_defaults import generation_defaults
from atomc.engine.inputs import InputProcessor
from atomc.engine.model_files import resolve_model
from atomc.engine.parallel_executor import ParallelExecutor
from atomc.engine.scheduler import ScheduledSeq, Scheduler
from atomc.engine.sequence import SeqStatus, Sequence
from atomc.engine.start_up import block_pools, runner_phases, served_model_name
from atomc.engine.step_input import build_step_input
from atomc.engine.structured_outputs import GrammarCompiler
from atomc.engine.structured_step import StructuredSteps
from atomc.engine.tokenizer import load_decoding_tokenizer, load_tokenizer
from atomc.outputs import CompletionOutput, RequestOutput
from atomc.runtime import distributed
from atomc.runtime.model_runner import PendingStep
from atomc.runtime.stage_runner import runner_class
from atomc.sampling_params import SamplingParams

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # consecutive failed steps after which the engine gives up (step() raises)


def _tracks_logprob(p: SamplingParams) -> bool:
    return p.logprobs is not None or p.ranks_samples


class _Request:
    def __init__(self, request_id: str, prompt: str | None, seqs: list[Sequence], arrival: float, tokenizer):
        self.request_id, self.prompt, self.seqs = request_id, prompt, seqs
        self.prompt_token_ids = seqs[0].prompt_token_ids  # sliced once, not at every output
        self.detok = [DetokenizerState.start(tokenizer, s.prompt_token_ids, s.params.skip_special_tokens) for s in seqs]
        self.metrics = {"arrival_time": arrival}

    @property
    def finished(self) -> bool:
        # runs for every touched request each step: a plain loop, no generator per call
        for s in self.seqs:
            if s.status is not SeqStatus.FINISHED:
                return False
        return True


@dataclass
class _Launched:
    """A step queued on the device whose sampled tokens have not been read back."""

    step_id: int
    samplers: list[Sequence]  # one per sampled row, in row order
    pending: PendingStep
    reads_history: bool  # a row's next sampling needs this step's token on the host
    masked_rows: list[int]  # sampled rows under structured outputs (see StructuredSteps)


class LLMEngine(EngineClient):
    def __init__(self, config: EngineConfig, decode_only_tokenizer: bool = False):
        """`decode_only_tokenizer`: a front end tokenizes and renders chat templates (the engine
        process), so the engine loads only what decoding needs (engine/tokenizer.py says why)."""
        t0 = time.perf_counter()
        self.config = config
        self.device, self.model_dir, self.arch, self.dtype, self.max_model_len = resolve_model(config)
        t_tok = time.perf_counter()
        load = load_decoding_tokenizer if decode_only_tokenizer else load_tokenizer
        self.tokenizer = load(Path(config.model.tokenizer or self.model_dir))
        t_tok = time.perf_counter() - t_tok
        self.inputs = InputProcessor(
            self.tokenizer, self.arch.vocab_size, self.max_model_len, config.serve.chat_template
        )
        self.model_name = served_model_name(config)
        # start-up phases, each logged with its time: where a slow (or silent) start goes
        t1 = time.perf_counter()
        log.info("start-up: model folder %.1fs, tokenizer %.1fs (%s)", t1 - t0 - t_tok, t_tok, self.model_dir.name)
        self.executor = self._start_workers()
        try:
            shard = distributed.parallel_info(config.parallel)
            self.runner = runner_class(shard)(
                config, self.model_dir, self.arch, self.device, self.dtype, self.max_model_len, shard
            )
            self.block_pools = block_pools(config, self.runner, self.max_model_len)
            if self.device.startswith("cuda") and not config.compile.enforce_eager:
                t3 = time.perf_counter()
                self.runner.capture_graphs(self.max_model_len)  # every rank the same sizes (collectives inside)
                log.info("start-up: CUDA graphs captured in %.1fs", time.perf_counter() - t3)
            if self.executor is not None:
                self.executor.wait_ready(self.runner.group_num_blocks)
        except BaseException as e:
            if self.executor is not None:
                raise self.executor.failure(e) from e
            raise
        t2 = time.perf_counter()
        phases = runner_phases(self.runner)
        log.info("start-up: %s, KV cache (%d blocks): %.1fs in all", phases, self.runner.num_blocks, t2 - t1)
        self.blocks = self.block_pools[0]
        # pipeline stages: a sequence is in one step in flight at most (its next input is sampled
        # only when that step's logits come back from the last stage), and up to P steps of
        # disjoint sequences are in flight so that the stages work at once
        stages = config.parallel.pipeline_parallel_size
        micro_batches = stages if config.scheduler.async_scheduling else 1
        self.scheduler = Scheduler(config.scheduler, self.block_pools, micro_batches=micro_batches)
        # steps left in flight when step() returns: none (synchronous), one (async), P - 1 (stages)
        self._keep_in_flight = (stages - 1 if stages > 1 else 1) if config.scheduler.async_scheduling else 0
        self.eos_token_ids = self._eos_token_ids()
        # structured outputs: xgrammar is imported at the first constraint, never before
        tokenizer_dir = Path(config.model.tokenizer or self.model_dir)
        self.grammars = GrammarCompiler(
            (lambda: load_tokenizer(tokenizer_dir)) if decode_only_tokenizer else self.tokenizer,
            self.arch.vocab_size,
            self.eos_token_ids,
        )
        # an engine behind a front end compiles on a thread (its front end compiled once already
        # to check the constraint); an in-process one at add_request, where errors are the caller's
        self.structured = StructuredSteps(self.grammars, self.device, compile_on_thread=decode_only_tokenizer)
        # sampling values a request does not set come from here (see generation_defaults.py)
        self.sampling_defaults = generation_defaults(self.model_dir, config.model.generation_config)
        self.requests: dict[str, _Request] = {}
        self.last_step: dict = {}
        self._launched: deque[_Launched] = deque()  # oldest first; read back in launch order
        self._seq_ids = itertools.count()
        self._step_ids = itertools.count()
        self._late_compiles = lambda: 0
        if self.device.startswith("cuda"):
            from atomc.kernels.triton import compile_watch  # only where Triton kernels run

            compile_watch.start()  # from here a Triton compile is a stall: logged
            self._late_compiles = compile_watch.late_compiles
        log.info("start-up: engine ready in %.1fs", time.perf_counter() - t0)
        self._failed_steps = 0  # consecutive
        self.num_failed_steps = 0
        self.num_sampler_fallbacks = 0

    def _start_workers(self) -> ParallelExecutor | None:
        """Tensor or pipeline parallelism: the worker processes (ranks 1..N-1); this process is rank 0."""
        par = self.config.parallel
        if distributed.world_size(par) == 1:
            return None
        executor = ParallelExecutor(self.config, self.model_dir, self.arch, self.device, self.dtype, self.max_model_len)
        if self.device.startswith("cuda"):
            self.device = "cuda:0"
        return executor

    @property
    def _in_flight(self) -> _Launched | None:
        """The newest launched step not read back yet."""
        return self._launched[-1] if self._launched else None

    def close(self) -> None:
        """Stop the worker processes (nothing to do for one rank)."""
        if self.executor is not None:
            self.executor.close()

    def _eos_token_ids(self) -> list[int]:
        ids = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return sorted(ids)

    # -- requests ------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.inputs.prompt_ids(prompt, params, add_special_tokens)
        params.eos_token_ids = self.eos_token_ids
        seqs = []
        for i in range(params.num_samples):  # best_of samples when set; the best n are returned
            seq = Sequence(next(self._seq_ids), request_id, i, list(ids), len(ids), params)
            seq.max_num_tokens = self.max_model_len
            if params.max_tokens is not None:
                seq.max_num_tokens = min(seq.max_num_tokens, len(ids) + params.max_tokens)
            seqs.append(seq)
        ready = params.structured_outputs is None or self.structured.prepare(request_id, seqs)
        req = _Request(request_id, text, seqs, arrival_time or time.perf_counter(), self.tokenizer)
        self.requests[request_id] = req
        if not ready:
            return  # its grammar compiles on the engine's grammar thread; scheduled once it is built
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output (None if unknown)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step (see `_step`); a step that raises fails its own requests instead (see `_fail_step`)."""
        before = dict(self.requests)
        try:
            outputs = self._step()
        except Exception as e:
            if self.executor is not None:  # the ranks may be out of step: nothing can run again
                raise self.executor.failure(e) from e
            return self._fail_step(e, before)
        self._failed_steps = 0
        return outputs

    def _fail_step(self, error: Exception, before: dict[str, _Request]) -> list[RequestOutput]:
        """End every request the failed step held (running, or with a token in flight) with an error
        output and free its blocks; requests that finished before the failure keep their output."""
        self._failed_steps += 1
        self.num_failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise error
        in_flight = {seq.request_id for launched in self._launched for seq in launched.samplers}
        self._launched.clear()  # their tokens are lost with the steps
        outputs = [self._output(req, True) for rid, req in before.items() if rid not in self.requests]
        failed = []
        for rid, req in list(self.requests.items()):
            involved = rid in in_flight or any(
                s.status is SeqStatus.RUNNING or s.num_pending or s.num_computed_tokens for s in req.seqs
            )
            if not involved:
                continue  # still waiting, never in a batch: it runs later as usual
            for seq in req.seqs:
                seq.num_pending = 0
                if not seq.finished:
                    self.scheduler.finish(seq, "abort")
            del self.requests[rid]
            out = self._output(req, True)
            out.error = f"{type(error).__name__}: {error}"
            outputs.append(out)
            failed.append(rid)
        log.error("engine step failed; failing its %d request(s) %s", len(failed), failed[:8], exc_info=error)
        return outputs

    def _step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the steps whose tokens were read back.

        With async scheduling that is the step launched by the previous call: step N+1 is scheduled
        and queued on the device before step N's tokens are read, so this host work runs while the
        device computes. Inputs still on the device reach step N+1 there (see ModelRunner.launch);
        a sequence that step N finishes has one extra token computed in N+1, then dropped.

        Pipeline stages keep up to P - 1 steps in flight after a call (P with the one launched),
        each of sequences no other in-flight step holds: the oldest is read back once that many
        are queued, or when nothing new can be scheduled."""
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        if self.structured.compiling:
            outputs = self._admit_compiled()
        newest = self._in_flight
        if newest is not None and newest.reads_history and self.scheduler.schedule_in_flight:
            outputs += self._complete_oldest()  # its rows' samplers need the tokens first
        scheduled = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = self._launch(scheduled) if scheduled else None
        t2 = time.perf_counter()
        # the earlier steps that stay in flight beside this one; with nothing scheduled the oldest
        # is read back (so its sequences can run again)
        limit = self._keep_in_flight - 1 if scheduled else len(self._launched) - 1
        while len(self._launched) > max(limit, 0):
            outputs += self._complete_oldest()
        if launched is not None and launched.masked_rows:
            # every constrained row's matcher has its previous token now: mask and sample this step
            self.structured.finish_sampling(launched.pending, launched.samplers, launched.masked_rows)
        if launched is not None:
            self._launched.append(launched)
        if launched is not None and not self.config.scheduler.async_scheduling:
            outputs += self._complete_oldest()
        if not scheduled and not self._launched and self.structured.compiling:
            self.structured.wait_compiled(0.005)  # only grammars are being built: do not spin
        # wall-clock split of the last step, for host-overhead measurements (benchmarks/host_overhead.py)
        self.last_step = {
            "num_seqs": len(scheduled),
            "num_tokens": sum(item.num_new_tokens for item in scheduled),
            "schedule_s": t1 - t0,
            "launch_s": t2 - t1,
            "complete_s": time.perf_counter() - t2,  # waiting for the tokens + stop checks and outputs
        }
        return outputs

    def _complete_oldest(self) -> list[RequestOutput]:
        return self._complete(self._launched.popleft())

    def _launch(self, scheduled: list[ScheduledSeq]) -> _Launched | None:
        in_flight = self._in_flight.step_id if self._in_flight is not None else None
        step, samplers = build_step_input(
            scheduled,
            self.blocks.block_size,
            next(self._step_ids),
            in_flight,
            self.scheduler.take_finished(),
            len(self.block_pools),
        )
        if self.executor is not None:
            self.executor.send(step)  # the workers run the same step's forward beside this one
        pending = self.runner.launch(step)
        if step.prompt_logprobs:
            # computing them waited for the forward already; kept now, before a later schedule can
            # preempt the sequence (which restarts its prompt logprobs)
            by_id = {item.seq.seq_id: item.seq for item in scheduled}
            for seq_id, entries in pending.prompt_logprobs.items():
                by_id[seq_id].prompt_logprobs.extend(entries)
        self.scheduler.commit_computed(scheduled)
        if not samplers:
            return None
        for k, seq in enumerate(samplers):
            seq.num_pending += 1
            seq.pending_row = k
        return _Launched(step.step_id, samplers, pending, bool(step.token_history), step.masked_rows)

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        """Read a launched step's tokens back: append them, detokenize, check stops, build outputs."""
        sampled = launched.pending.result()
        self.num_sampler_fallbacks += sampled.num_fallbacks
        vocab = self.arch.vocab_size
        touched: dict[str, _Request] = {}
        now = time.perf_counter()
        for k, seq in enumerate(launched.samplers):
            seq.num_pending -= 1
            if seq.finished:
                continue  # stopped or aborted while this token was being computed: dropped
            req = self.requests[seq.request_id]
            touched[seq.request_id] = req
            token = sampled.token_ids[k]
            if not 0 <= token < vocab:  # never feed the next step an id the embedding cannot look up
                raise RuntimeError(f"the sampler returned token id {token}, outside the vocabulary [0, {vocab})")
            seq.token_ids.append(token)
            if sampled.logprobs[k] is not None:  # asked for, or to rank best_of samples
                if seq.params.logprobs is not None:
                    seq.logprobs.append(sampled.logprobs[k])
                seq.cumulative_logprob += sampled.logprobs[k][token]
            req.metrics.setdefault("first_token_time", now)
            checked = len(seq.text)
            self._append_text(req, seq)
            if seq.grammar is not None and not self.structured.accept(seq, token):
                self.scheduler.finish(seq, "abort")  # the grammar refused the token (the sampler fell back)
            else:
                self._check_stop(seq, token, checked)
                if seq.grammar is not None and not seq.finished and seq.grammar.is_terminated:
                    self.scheduler.finish(seq, "stop")  # complete, its stop token taken under ignore_eos
            if seq.finished and not isinstance(seq.stop_reason, str):
                seq.text += decode_rest(
                    self.tokenizer, seq.token_ids, req.detok[seq.index], seq.params.skip_special_tokens
                )
        outputs = []
        for request_id, req in touched.items():
            done = req.finished
            if done:
                req.metrics["finish_time"] = now
                del self.requests[request_id]
            outputs.append(self._output(req, done))
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar the compile thread finished; fail those it could not
        compile (their front end compiled the same constraint, so this is not expected)."""
        outputs = []
        for request_id, error in self.structured.take_compiled():
            req = self.requests.get(request_id)
            if req is None:
                continue  # aborted while compiling
            if error is None:
                for seq in req.seqs:
                    if not seq.finished:
                        self.scheduler.add(seq)
                continue
            for seq in req.seqs:
                if not seq.finished:
                    self.scheduler.finish(seq, "abort")
            del self.requests[request_id]
            out = self._output(req, True)
            out.error = f"{type(error).__name__}: {error}"
            outputs.append(out)
        return outputs

    def _append_text(self, req: _Request, seq: Sequence) -> None:
        state = req.detok[seq.index]
        seq.text += decode_step(self.tokenizer, seq.token_ids, state, seq.params.skip_special_tokens)

    def _check_stop(self, seq: Sequence, token: int, checked: int) -> None:
        """Finish `seq` if `token` or the text after position `checked` ends it."""
        p = seq.params
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return self.scheduler.finish(seq, "stop")
            if token in p.stop_token_ids:
                return self.scheduler.finish(seq, "stop", token)
        if n_out > p.min_tokens:  # as vLLM: no stop string ends in the first min_tokens tokens' text
            for stop in p.stop:
                # a new match must overlap the new text: search from just before it
                idx = seq.text.find(stop, max(0, checked - len(stop) + 1))
                if idx >= 0:
                    seq.text = seq.text[: idx + len(stop)] if p.include_stop_str_in_output else seq.text[:idx]
                    return self.scheduler.finish(seq, "stop", stop)
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return self.scheduler.finish(seq, "length")
        if seq.num_tokens >= self.max_model_len:
            return self.scheduler.finish(seq, "length")
        return None

    def _output(self, req: _Request, finished: bool | None = None) -> RequestOutput:
        first = req.seqs[0]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=s.index,
                    text=s.text,
                    token_ids=s.output_token_ids,  # a fresh slice: the caller may keep it
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
                    cumulative_logprob=s.cumulative_logprob if _tracks_logprob(s.params) else None,
                )
                for s in req.seqs
            ],
            finished=req.finished if finished is None else finished,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=list(first.prompt_logprobs) if first.params.prompt_logprobs is not None else None,
            metrics=dict(req.metrics),
        )

    def stats(self) -> dict:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            # the fullest pool: the one that stops admission; block counts over every pool (KV group)
            "kv_cache_usage": max(pool.usage() for pool in self.block_pools),
            "num_free_blocks": sum(pool.num_free_blocks for pool in self.block_pools),
            "num_total_blocks": sum(pool.num_usable_blocks for pool in self.block_pools),
            "prefix_cache_queries": self.blocks.prefix_queries,
            "prefix_cache_hits": self.blocks.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_sampler_fallbacks": self.num_sampler_fallbacks,
            "num_failed_steps": self.num_failed_steps,
            "num_triton_compiles_while_serving": self._late_compiles(),
        }
