"""Prompts in: text or token ids -> checked token ids, and chat messages -> prompt text.

One place for the checks a prompt must pass (not empty, ids in the vocabulary, fits the context with
its max_tokens), shared by the engine and by the server's front end. Here too, where the tokenizer
and the vocabulary are known: `truncate_prompt_tokens` (keep the last k prompt tokens), the ids of
`logit_bias` and `allowed_token_ids` checked against the vocabulary, and `bad_words` tokenized.
With the engine in its own process, the front end runs them before anything crosses the pipe, so a
bad prompt is a 400 at once and the engine process only ever sees good ones.
"""

from __future__ import annotations

from atomc.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.chat_template = chat_template  # --chat-template; the tokenizer's own when None

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]

    def apply_chat_template(
        self,
        messages: list[dict],
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs,
    ) -> str:
        """The prompt text; `tools` (OpenAI's tool definitions) and `kwargs` (a request's
        chat_template_kwargs, such as enable_thinking) reach the template as its variables;
        `continue_final_message` leaves the last message open (no end-of-turn), so the model
        continues it (/tokenize's option, as vLLM's)."""
        template = chat_template or self.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; pass one with --chat-template")
        extra = {"continue_final_message": True} if continue_final_message else {}
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **extra,
            **kwargs,
        )

    def prompt_ids(self, prompt: str | list[int], params: SamplingParams, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids, checked; raises ValueError with a message fit for the user."""
        ids = self.tokenize(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)
        k = params.truncate_prompt_tokens
        if k is not None:
            if k > self.max_model_len:
                raise ValueError(
                    f"truncate_prompt_tokens ({k}) is greater than the context of {self.max_model_len} tokens; "
                    "choose a smaller truncation size"
                )
            ids = ids[-k:]  # the last k: what a chat or a long document ends with is what matters
        self.check(ids, params)
        self.prepare_token_fields(params)
        return ids

    def prepare_token_fields(self, params: SamplingParams) -> None:
        """Check logit_bias / allowed_token_ids against the vocabulary and tokenize bad_words (once:
        params that already carry their bad words' ids, from a front end, are left as they are)."""
        vocab = self.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab}): {sorted(bad)[:5]}")
        if params.bad_words and not params.bad_words_token_ids:
            params.bad_words_token_ids = bad_words_token_ids(params.bad_words, self._encode_word, vocab)

    def _encode_word(self, text: str) -> list[int]:
        return self.tokenize(text, add_special_tokens=False)

    def check(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                "(prompt plus at least one generated token must fit)"
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{self.max_model_len} tokens"
            )


def bad_words_token_ids(words: list[str], encode, vocab_size: int) -> list[list[int]]:
    """Each word's token ids as vLLM bans them: the word as written (leading spaces dropped), and,
    when a space before it starts a different first token of the same length, that spelling too
    (a word inside a sentence is usually tokenized with its space)."""
    out: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        if not plain:
            raise ValueError(f"bad_words: {word!r} tokenizes to no token")
        out.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    bad = sorted({t for ids in out for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"bad_words tokenize to ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return out
