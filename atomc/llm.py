"""LLM: the offline API, shaped like vLLM's (`LLM(model=...)`, `generate`, `chat`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from atomc.config import EngineConfig
from atomc.outputs import RequestOutput
from atomc.sampling_params import SamplingParams
from atomc.serve.engine import LLMEngine

PromptType = str | dict


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        seed: int = 0,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        cache_dir: str | None = None,
        load_format: str = "safetensors",
        generation_config: str = "auto",
        cudagraph_mixed_max_tokens: int = 0,
        async_scheduling: bool = True,
        config: EngineConfig | None = None,
    ):
        if config is None:
            config = EngineConfig(device=device)
            m, c, s = config.model, config.cache, config.scheduler
            m.model, m.tokenizer, m.dtype, m.max_model_len, m.seed = (
                model,
                tokenizer,
                dtype,
                max_model_len,
                seed,
            )
            s.max_num_seqs, s.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
            s.async_scheduling = async_scheduling
            c.block_size, c.enable_prefix_caching, c.num_kv_blocks = (
                block_size,
                enable_prefix_caching,
                num_kv_blocks,
            )
            c.gpu_memory_utilization = gpu_memory_utilization
            config.compile.enforce_eager = enforce_eager
            config.compile.cudagraph_mixed_max_tokens = cudagraph_mixed_max_tokens
            m.load_format, m.generation_config = load_format, generation_config
            if cache_dir is not None:
                config.compile.cache_dir = cache_dir
        self.config = config
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

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
        order = []
        for prompt, p in zip(prompts, params_list, strict=True):
            rid = str(next(self._ids))
            if isinstance(prompt, dict):
                if "prompt_token_ids" not in prompt:
                    raise ValueError("a dict prompt needs 'prompt_token_ids'")
                self.engine.add_request(rid, list(prompt["prompt_token_ids"]), _copy(p))
            else:
                self.engine.add_request(rid, prompt, _copy(p))
            order.append(rid)
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
        order = []
        for conv in conversations:
            text = self.engine.apply_chat_template(conv, chat_template)
            rid = str(next(self._ids))
            # the template already holds any BOS text; adding special tokens again would double it
            self.engine.add_request(rid, text, _copy(params), add_special_tokens=False)
            order.append(rid)
        return self._run(order, use_tqdm)

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
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
        return [done[rid] for rid in order]


def _copy(p: SamplingParams) -> SamplingParams:
    # the engine writes eos ids into params; keep the caller's object untouched
    import dataclasses

    return dataclasses.replace(p)
