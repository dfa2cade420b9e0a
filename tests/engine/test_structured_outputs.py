"""Structured outputs: compiling each kind, the cache, the matcher's advance, the bitmask and its
application, and the engine end to end (constrained rows beside unconstrained ones, async
scheduling on and off, the engine-process compile thread)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from atomc.engine.structured_outputs import (
    GrammarCompiler,
    GrammarError,
    SequenceGrammar,
    available,
    bitmask_width,
    bound_strings,
    cache_key,
    choice_ebnf,
    fill_bitmask,
)
from atomc.engine.tokenizer import load_tokenizer
from atomc.runtime.sampler import apply_token_bitmask
from atomc.sampling_params import SamplingParams
from atomc.sampling_params import StructuredOutputsParams as SO
from tests.engine.helpers import PROMPTS, assert_pool_free, make

pytestmark = pytest.mark.skipif(not available(), reason="xgrammar is not installed")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "ok"],
}
EXTRA_VOCAB = 16  # the model's logits wider than the tokenizer, as padded checkpoints have


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return load_tokenizer(llama_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer) + EXTRA_VOCAB, [tokenizer.eos_token_id])


def allowed_ids(grammar: SequenceGrammar, width: int) -> set[int]:
    bm = torch.empty((1, width), dtype=torch.int32)
    fill_bitmask([grammar], bm)
    bits = [(int(w) >> j) & 1 for w in bm[0].tolist() for j in range(32)]
    return {i for i, b in enumerate(bits) if b}


def feed_text(g: SequenceGrammar, tokenizer, text: str) -> None:
    for t in tokenizer(text, add_special_tokens=False)["input_ids"]:
        assert g.accept(t), f"token {t} of {text!r} refused"


# ---------------------------------------------------------------- compilation and the cache


@pytest.mark.parametrize(
    "so",
    [SO(json=SCHEMA), SO(json=json.dumps(SCHEMA)), SO(regex=r"\d{3}"), SO(choice=["yes", "no"]),
     SO(grammar='root ::= "a" | "b"'), SO(json_object=True)],
    ids=["json", "json-text", "regex", "choice", "grammar", "json_object"],
)  # fmt: skip
def test_each_kind_compiles(compiler, so):
    assert compiler.compile(so) is not None


def test_the_cache_compiles_each_constraint_once(tokenizer):
    c = GrammarCompiler(tokenizer, len(tokenizer))
    reordered = {"required": SCHEMA["required"], "properties": SCHEMA["properties"], "type": "object"}
    first = c.compile(SO(json=SCHEMA))
    assert c.compile(SO(json=reordered)) is first  # the same schema, keys in another order
    assert c.compile(SO(json=json.dumps(SCHEMA))) is first  # the same schema as text
    assert c.num_compiles == 1
    c.compile(SO(json=SCHEMA, disable_any_whitespace=True))  # another grammar
    c.compile(SO(regex="a+"))
    assert c.num_compiles == 3
    assert c.cached(SO(regex="a+")) is not None and c.cached(SO(regex="b+")) is None


@pytest.mark.parametrize(
    "so, kind, words",
    [(SO(json={"type": "strin"}), "json", "strin"), (SO(json="{not json"), "json", "not valid JSON"),
     (SO(json={"$ref": "#/nowhere"}), "json", "nowhere"), (SO(regex="[a-"), "regex", "Unclosed"),
     (SO(grammar="root ::= undefined_rule"), "grammar", "undefined_rule")],
)  # fmt: skip
def test_a_constraint_that_cannot_compile_names_its_kind(compiler, so, kind, words):
    with pytest.raises(GrammarError, match=words) as e:
        compiler.compile(so)
    assert e.value.kind == kind and isinstance(e.value, ValueError)
    assert ".cc:" not in str(e.value)  # xgrammar's C++ location is cut from the message


def test_length_bounded_strings_hold_no_control_characters(compiler, tokenizer):
    """xgrammar 0.2 lets raw control characters into minLength/maxLength strings; bound_strings
    turns the bounds into a pattern that keeps them out and keeps the bounds."""
    pattern = r'^[^"\\\x00-\x1f]{0,3}$'
    assert bound_strings({"type": "string", "maxLength": 3}) == {"type": "string", "pattern": pattern}
    kept = {"type": "string", "maxLength": 3, "pattern": "a+"}
    assert bound_strings(kept) == kept
    bounded = {"type": "string", "minLength": 1, "maxLength": 3}
    schema = {"type": "object", "properties": {"s": bounded}, "required": ["s"]}
    eos = tokenizer.eos_token_id

    def matches(text: str) -> bool:
        g = compiler.matcher(SO(json=schema, disable_any_whitespace=True), [eos])
        return g.matcher.accept_string(text) and g.is_completed

    assert matches('{"s": "abc"}') and matches('{"s": "é"}')
    assert not matches('{"s": ""}') and not matches('{"s": "abcd"}') and not matches('{"s": "a\x1d"}')


def test_cache_key_and_choice_grammar():
    assert cache_key(SO(choice=["a", "b"])) == ("choice", ("a", "b"), False)
    with pytest.raises(GrammarError, match="must be an object"):
        cache_key(SO(json="[1, 2]"))
    assert choice_ebnf(['say "hi"', "a\\b"]) == 'root ::= "say \\"hi\\"" | "a\\\\b"'


# ---------------------------------------------------------------- the matcher and the bitmask


def test_matcher_allows_eos_only_when_the_grammar_is_complete(compiler, tokenizer):
    eos = tokenizer.eos_token_id
    g = compiler.matcher(SO(regex="abc"), [eos])
    width = compiler.bitmask_width()
    assert width == bitmask_width(len(tokenizer) + EXTRA_VOCAB)
    allowed = allowed_ids(g, width)
    assert eos not in allowed and allowed  # something to start with, but not the end
    assert all(tokenizer.decode([t]) and "abc".startswith(tokenizer.decode([t])) for t in allowed)
    # padded ids past the tokenizer are never allowed
    assert not any(t >= len(tokenizer) for t in allowed)
    feed_text(g, tokenizer, "abc")
    assert g.is_completed and not g.is_terminated
    assert allowed_ids(g, width) == {eos}
    assert g.accept(eos) and g.is_terminated
    assert g.num_accepted == len(tokenizer("abc", add_special_tokens=False)["input_ids"]) + 1


def test_matcher_refuses_a_token_outside_the_grammar(compiler, tokenizer):
    g = compiler.matcher(SO(regex="[0-9]+"), [tokenizer.eos_token_id])
    letter = tokenizer("x", add_special_tokens=False)["input_ids"][0]
    assert not g.accept(letter) and g.rejected == letter and g.num_accepted == 0


def test_sync_catches_up_and_rebuilds(compiler, tokenizer):
    ids = tokenizer('{"name": "ab", "ok": true}', add_special_tokens=False)["input_ids"]
    g = compiler.matcher(SO(json=SCHEMA), [tokenizer.eos_token_id])
    assert g.sync(ids[:3]) and g.num_accepted == 3
    assert g.sync(ids) and g.is_completed  # takes the rest
    assert g.sync(ids[:2]) and g.num_accepted == 2 and not g.is_completed  # shorter: rebuilt from scratch
    assert g.sync(ids) and g.is_completed


def test_fill_bitmask_rows_and_the_none_rows(compiler, tokenizer):
    width = compiler.bitmask_width()
    a = compiler.matcher(SO(regex="a"), [tokenizer.eos_token_id])
    b = compiler.matcher(SO(regex="[0-9]"), [tokenizer.eos_token_id])
    bm = torch.zeros((3, width), dtype=torch.int32)
    fill_bitmask([a, None, b], bm)
    assert (bm[1] == -1).all()  # no grammar: every token
    single = torch.zeros((1, width), dtype=torch.int32)
    b.fill(single, 0)
    assert torch.equal(bm[2], single[0])  # each row is its own matcher's
    assert not torch.equal(bm[0], bm[2])
    rows = torch.full((4, width), 7, dtype=torch.int32)
    fill_bitmask([b, a], rows, [3, 1])  # grammar i fills row rows[i]; the other rows are not written
    assert torch.equal(rows[3], bm[2]) and torch.equal(rows[1], bm[0])
    assert (rows[[0, 2]] == 7).all()


def test_apply_token_bitmask_forbids_exactly_the_unset_bits():
    torch.manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partial
    logits = torch.randn(3, vocab)
    allowed = [{0, 5, 31, 32, 69}, {1}, set(range(vocab))]
    bm = torch.zeros((3, bitmask_width(vocab)), dtype=torch.int32)
    for r, ids in enumerate(allowed):
        for t in ids:
            word = int(bm[r, t // 32]) | (1 << (t % 32))
            bm[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32 wraps
    want = logits.clone()
    apply_token_bitmask(logits, bm)
    for r, ids in enumerate(allowed):
        finite = {i for i in range(vocab) if torch.isfinite(logits[r, i])}
        assert finite == ids
        assert torch.equal(logits[r, sorted(ids)], want[r, sorted(ids)])  # allowed logits untouched


def test_apply_token_bitmask_to_some_rows_and_a_narrow_mask():
    logits = torch.zeros(4, 40)
    bm = torch.zeros((4, 1), dtype=torch.int32)  # rows not masked are not read: all-forbidding here
    bm[2] = -1  # 32 bits for a 40-wide row: ids 32..39 forbidden
    apply_token_bitmask(logits, bm, [2])
    assert torch.isfinite(logits[[0, 1, 3]]).all()
    assert torch.isfinite(logits[2, :32]).all() and torch.isinf(logits[2, 32:]).all()
    with pytest.raises(ValueError, match="bitmask has 1 rows"):
        apply_token_bitmask(logits, bm[:1], [0])


# ---------------------------------------------------------------- the engine


# a random-weight model left free to emit JSON whitespace emits it until max_tokens; the tests that
# need a complete document turn that freedom off (disable_any_whitespace)
def _constrained(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=80, structured_outputs=SO(**kw))


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_mixed_batches_leave_unconstrained_rows_as_they_are_alone(llama_dir, async_scheduling):
    llm = make(llama_dir, async_scheduling=async_scheduling)
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    json_row = _constrained(json=SCHEMA, disable_any_whitespace=True)
    params = [json_row, plain, _constrained(regex=r"[a-c]{2}-\d{2}"), plain, plain]
    outs = llm.generate(PROMPTS, params)
    for i in (1, 3, 4):
        assert outs[i].outputs[0].token_ids == alone[i]
    doc = json.loads(outs[0].outputs[0].text)
    jsonschema.validate(doc, SCHEMA)
    assert re.fullmatch(r"[a-c]{2}-\d{2}", outs[2].outputs[0].text)
    assert outs[0].outputs[0].finish_reason == "stop" and outs[2].outputs[0].finish_reason == "stop"
    assert_pool_free(llm)


def test_sampled_choices_and_json_objects(llama_dir):
    llm = make(llama_dir)
    choices = ["yes", "no", 'a "quoted" one']
    out = llm.generate(["x"], SamplingParams(temperature=1.0, seed=3, n=6, max_tokens=20,
                                             structured_outputs=SO(choice=choices)))[0]  # fmt: skip
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs)
    # greedy: a random model's sampled object keys can run to max_tokens; these close at once
    objs = llm.generate(PROMPTS[:3], _constrained(json_object=True, disable_any_whitespace=True))
    assert all(isinstance(json.loads(o.outputs[0].text), dict) for o in objs)
    assert_pool_free(llm)


def test_a_bad_constraint_is_a_value_error_at_add_request(llama_dir):
    llm = make(llama_dir)
    with pytest.raises(ValueError, match="invalid regex constraint"):
        llm.generate(["x"], _constrained(regex="(unclosed"))
    assert not llm.engine.has_unfinished_requests()


def test_unconstrained_steps_take_the_plain_path(llama_dir):
    llm = make(llama_dir)
    runner, seen = llm.engine.runner, []
    launch = runner.launch

    def spy(step):
        pending = launch(step)
        seen.append((list(step.masked_rows), pending is not None and pending.needs_bitmask))
        return pending

    runner.launch = spy
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4))
    assert seen and all(rows == [] and not deferred for rows, deferred in seen)
    seen.clear()
    llm.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=4), _constrained(regex="[ab]+")])
    assert any(rows == [1] and deferred for rows, deferred in seen)


def test_the_compile_thread_holds_a_request_until_its_grammar_is_built(llama_dir):
    """An engine process compiles on a thread: the request waits outside the scheduler, then runs;
    one aborted while compiling leaves nothing behind; a failed compile fails only its request."""
    llm = make(llama_dir)
    engine = llm.engine
    engine.structured._compile_on_thread = True
    plain = SamplingParams(temperature=0, max_tokens=8)
    engine.add_request("plain", PROMPTS[0], plain)
    schema = {"type": "object", "properties": {"q": {"enum": [1, 2]}}, "required": ["q"]}
    engine.add_request("json", PROMPTS[1], _constrained(json=schema, disable_any_whitespace=True))
    engine.add_request("gone", PROMPTS[2], _constrained(regex="z{2}"))
    engine.add_request("bad", PROMPTS[3], _constrained(regex="[z-"))
    assert engine.structured.compiling
    engine.abort_request("gone")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == {"plain", "json", "bad"}
    assert json.loads(finals["json"].outputs[0].text)["q"] in (1, 2)
    assert "invalid regex constraint" in finals["bad"].error
    assert finals["plain"].error is None
    assert_pool_free(llm)


@pytest.mark.parametrize("engine_kw", [dict(num_kv_blocks=8, max_model_len=128), dict(max_num_batched_tokens=7)],
                         ids=["preempting", "chunked"])  # fmt: skip
def test_preemption_recompute_and_chunked_prefill_keep_constrained_outputs(llama_dir, engine_kw):
    """A constrained sequence that is preempted (its KV freed, its tokens recomputed, partly from
    the prefix cache) or whose prompt runs in chunks keeps its matcher: the same tokens as a roomy
    engine, still valid."""
    params = [_constrained(regex=r"[a-e]{3,12}"), _constrained(json=SCHEMA, disable_any_whitespace=True)] * 3
    for p in params:
        p.max_tokens = 40
    prompts = (PROMPTS * 2)[:6]
    roomy = [o.outputs[0].token_ids for o in make(llama_dir).generate(prompts, params)]
    llm = make(llama_dir, **engine_kw)
    outs = llm.generate(prompts, params)
    if "num_kv_blocks" in engine_kw:
        assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == roomy
    for o, p in zip(outs, params, strict=True):
        if p.structured_outputs.kind == "json":
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        else:
            assert re.fullmatch(r"[a-e]{3,12}", o.outputs[0].text)
    assert_pool_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_gpu_constrained_rows_beside_graph_replayed_ones(llama_dir, async_scheduling):
    """On CUDA with decode graphs: the mask is applied to the graph's logits outside the graph, a
    pinned host bitmask reaches the device without a sync, unconstrained rows are unchanged."""
    from atomc import LLM

    llm = LLM(model=str(llama_dir), dtype="float32", device="cuda", max_num_seqs=8, async_scheduling=async_scheduling)
    assert llm.engine.runner.decode_graphs is not None
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    params = [_constrained(json=SCHEMA, disable_any_whitespace=True), plain, _constrained(choice=["ab", "cd"]),
              plain, plain]  # fmt: skip
    outs = llm.generate(PROMPTS, params)
    assert [outs[i].outputs[0].token_ids for i in (1, 3, 4)] == [alone[i] for i in (1, 3, 4)]
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
    assert outs[2].outputs[0].text in ("ab", "cd")
    logits = torch.randn(3, 100, device="cuda")
    bm = torch.zeros((3, bitmask_width(100)), dtype=torch.int32, pin_memory=True)
    bm[1, 0] = 0b101
    apply_token_bitmask(logits, bm, [1])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[[0, 2]]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_mask_kernel_matches_the_torch_path_without_a_sync():
    """The one-kernel GPU mask (xgrammar's Triton kernel) forbids exactly what the CPU path does, on
    a subset of rows and with a mask narrower than the logits, and queues no device sync."""
    from atomc.runtime.sampler import mask_with_torch

    torch.manual_seed(0)
    for vocab, width in ((1000, bitmask_width(1000)), (1000, 30)):  # 30 words = 960 tokens: narrow
        bm = torch.randint(-(2**31), 2**31 - 1, (6, width), dtype=torch.int32).pin_memory()
        logits = torch.randn(6, vocab)
        want = logits.clone()
        mask_with_torch(want, bm, [0, 2, 5])
        dev = logits.cuda()
        torch.cuda.synchronize()
        apply_token_bitmask(dev, bm, [0, 2, 5])  # first call: the row index tensor is made
        dev = logits.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            apply_token_bitmask(dev, bm, [0, 2, 5])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(dev.cpu(), want)
