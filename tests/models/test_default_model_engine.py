"""atomc's engine reproduces transformers' greedy tokens on the real default model (fp32, CPU, eager).

The reference is a plain argmax loop over transformers' forward, not `generate(..., min_new_tokens=32)`:
min_new_tokens masks EOS, while `ignore_eos=True` only keeps going past it, so the two would part at the
first EOS (the chat prompt below answers in 8 tokens, then EOS).
"""

from __future__ import annotations

import inspect

import torch

from atomc import LLM, SamplingParams

NEW_TOKENS = 32
# fp32 reductions in another order move logits by ~1e-5; a greedy pick may only differ on a near-tie
TIE_MARGIN = 5e-3


def prompts(tok) -> list[list[int]]:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    texts = [chat, "Once upon a time", "def fibonacci(n):"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was picked from."""
    # the KV cache argument is `past_key_values` up to transformers ~5.2x, `cache` after
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([ids]), use_cache=True)
    tokens, logits = [], []
    for _ in range(n):
        step = out.logits[0, -1].float()
        tokens.append(int(step.argmax()))
        logits.append(step)
        out = model(torch.tensor([tokens[-1:]]), use_cache=True, **{name: getattr(out, name)})
    return tokens, logits


def test_engine_matches_transformers_greedy(default_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    ref = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    prompt_ids = prompts(tok)

    llm = LLM(model=str(default_model), dtype="float32", device="cpu", enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    assert len(outs) == len(prompt_ids)

    for ids, out in zip(prompt_ids, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        want, logits = hf_greedy(ref, ids, NEW_TOKENS)
        assert len(got) == NEW_TOKENS, tok.decode(got)
        # identical up to the first difference, which must be a near-tie in transformers' logits
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if g != w:
                margin = float(logits[i][w] - logits[i][g])
                assert margin < TIE_MARGIN, (
                    f"step {i}: engine picked {g} {tok.decode([g])!r}, transformers {w} {tok.decode([w])!r} "
                    f"by a logit margin of {margin:.4f}\n"
                    f"engine: {tok.decode(got)!r}\nhf:     {tok.decode(want)!r}"
                )
                break


def test_cli_generate_default_model_answers_paris(default_model, model_cache_root):
    """The README's command: no --model means the default model, resolved from the installed wheel."""
    from typer.testing import CliRunner

    from atomc.cli.main import app

    args = ["generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "16"]
    result = CliRunner().invoke(app, [*args, "--enforce-eager", "--cache-dir", str(model_cache_root)])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output


def test_default_model_is_served_under_its_name(default_model, model_cache_root):
    llm = LLM(model=None, device="cpu", enforce_eager=True, cache_dir=str(model_cache_root), max_model_len=256)
    assert llm.engine.model_name == "SmolLM2-135M-Instruct"
