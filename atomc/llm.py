"""LLM: the offline API, shaped like vLLM's (`LLM(model=...)`, `generate`, `chat`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from atomc.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from atomc.engine.llm_engine import LLMEngine
from atomc.outputs import RequestOutput, best_of
from atomc.sampling_params import SamplingParams

PromptType = str | dict


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = ModelConfig.dtype,
        device: str = EngineConfig.device,
        enforce_eager: bool = CompileConfig.enforce_eager,
        max_model_len: int | None = None,
        seed: int = ModelConfig.seed,
        max_num_seqs: int = SchedulerConfig.max_num_seqs,
        max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
        block_size: int = CacheConfig.block_size,
        enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
        num_kv_blocks: int | None = None,
        kv_cache_dtype: str = CacheConfig.kv_cache_dtype,
        gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
        cache_dir: str | None = None,
        load_format: str = ModelConfig.load_format,
        quantization: str | None = ModelConfig.quantization,
        generation_config: str = ModelConfig.generation_config,
        cudagraph_mixed_max_tokens: int = CompileConfig.cudagraph_mixed_max_tokens,
        enable_pdl: bool = CompileConfig.enable_pdl,
        require_artifacts: bool = CompileConfig.require_artifacts,
        async_scheduling: bool = SchedulerConfig.async_scheduling,
        tensor_parallel_size: int = ParallelConfig.tensor_parallel_size,
        pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size,
        enable_expert_parallel: bool = ParallelConfig.enable_expert_parallel,
        one_shot_all_reduce: bool = ParallelConfig.one_shot_all_reduce,
        config: EngineConfig | None = None,
    ):
        """Each keyword sets the EngineConfig field of its name (defaults are the config's); or pass
        a whole `config`, and the keywords are ignored."""
        if config is None:
            values = {k: v for k, v in locals().items() if k not in ("self", "config", "__class__")}
            if cache_dir is None:
                del values["cache_dir"]  # None: the config's default location
            config = EngineConfig().update(**values)
        self.config = config
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the worker processes (tensor-parallel ranks, pipeline stages), if any (an exit does it too)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or self.engine.default_sampling_params()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        order: dict[str, int] = {}  # request id -> the n samples it returns (best_of may run more)
        for prompt, p in zip(prompts, params_list, strict=True):
            rid = str(next(self._ids))
            if isinstance(prompt, dict):
                if "prompt_token_ids" not in prompt:
                    raise ValueError("a dict prompt needs 'prompt_token_ids'")
                self.engine.add_request(rid, list(prompt["prompt_token_ids"]), _copy(p))
            else:
                self.engine.add_request(rid, prompt, _copy(p))
            order[rid] = p.n
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        chat_template: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = sampling_params or self.engine.default_sampling_params()
        order: dict[str, int] = {}
        for conv in conversations:
            text = self.engine.apply_chat_template(conv, chat_template)
            rid = str(next(self._ids))
            # the template already holds any BOS text; adding special tokens again would double it
            self.engine.add_request(rid, text, _copy(params), add_special_tokens=False)
            order[rid] = params.n
        return self._run(order, use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in order:  # leave no half-run request holding KV blocks
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [best_of(done[rid], n) for rid, n in order.items()]


def _copy(p: SamplingParams) -> SamplingParams:
    # the engine writes eos ids into params; keep the caller's object untouched
    import dataclasses

    return dataclasses.replace(p)
