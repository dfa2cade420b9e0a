"""Shared fixtures: tiny random checkpoints for each family, built once per test session.

Each checkpoint is a real Hugging Face directory (config.json, model.safetensors, tokenizer.json
with a chat template), written by transformers itself, so the loader is tested on the real format.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# the compile cache's signing key: one per test session, never the user's own (servers the tests
# start inherit it, so they verify what the tests built)
if "ATOMC_CACHE_SIGNING_KEY_FILE" not in os.environ:
    import tempfile

    # under pytest-xdist every worker of one run shares the key (key creation is race-safe), so an
    # entry one worker builds verifies in another
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    key_dir = Path(tempfile.gettempdir()) / f"atomc-test-key-{run_id}" if run_id else None
    key_dir = key_dir or Path(tempfile.mkdtemp(prefix="atomc-test-key-"))
    os.environ["ATOMC_CACHE_SIGNING_KEY_FILE"] = str(key_dir / "key")
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(1)  # one worker a core: torch's own threads would oversubscribe them
if not torch.cuda.is_available():
    # Triton runs only interpreted here, and the mode is fixed when triton is first imported:
    # set it before any test module (or atomc code it imports) brings triton in
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time there was a small engine that compiled graphs.",
    "def add(a, b):\n    return a + b\n",
    "Paged attention keeps keys and values in fixed-size blocks of memory.",
    "1 2 3 4 5 6 7 8 9 10 hello world, how are you today?",
] * 20
VOCAB = 384

FAMILIES = {
    "llama": dict(
        cls="LlamaConfig",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    ),
    "mistral": dict(cls="MistralConfig", head_dim=32, sliding_window=None, tie_word_embeddings=False),
    "qwen2": dict(cls="Qwen2Config", tie_word_embeddings=True),
    "qwen3": dict(cls="Qwen3Config", head_dim=32, tie_word_embeddings=True),
    # Phi-3 stores q/k/v and gate/up fused (qkv_proj, gate_up_proj): the weight_loader's shard_id=None path
    "phi3": dict(cls="Phi3Config", pad_token_id=0, tie_word_embeddings=False),
    # MoE: 8 experts, top-2, so a few tokens leave some experts idle and load the others unevenly
    "qwen3_moe": dict(
        cls="Qwen3MoeConfig",
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        cls="MixtralConfig", num_local_experts=8, num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False
    ),
    # GPT-OSS: four layers alternating an 8-token window and full attention (prompts run past the
    # window), 6 experts top-2 with biases, sinks and biases randomised (build_checkpoint) so they
    # matter, YaRN stretching a 64-token original context by 8
    "gpt_oss": dict(
        cls="GptOssConfig",
        num_hidden_layers=4,
        head_dim=16,
        intermediate_size=48,
        num_local_experts=6,
        num_experts_per_tok=2,
        sliding_window=8,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    ),
}
# DeepSeek (MLA): every head has its own K/V in transformers (num_key_value_heads = heads); rope
# dims 8 of a 24-wide q/k head, latent 32. V2-style: q straight from q_proj, softmax routing
# without groups or renormalisation, two shared experts, every layer sparse. V3-style: q through a
# LoRA, sigmoid scores with a correction bias (randomised in build_checkpoint so it changes the
# choice), 4 groups of which 2 are kept, one shared expert, a dense first layer, YaRN with both
# mscales (a rope-table factor and a softmax-scale factor that differ from 1)
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    tie_word_embeddings=False,
)
DEEPSEEK = {
    "deepseek_v2": dict(
        cls="DeepseekV2Config", q_lora_rank=None, n_shared_experts=2, first_k_dense_replace=0,
        topk_method="greedy", routed_scaling_factor=1.5, **MLA,
    ),
    "deepseek_v3": dict(
        cls="DeepseekV3Config", num_hidden_layers=3, q_lora_rank=24, n_shared_experts=1, first_k_dense_replace=1,
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8,
            "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 128,
        },
        **MLA,
    ),
}  # fmt: skip
FAMILIES.update(DEEPSEEK)


def build_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_checkpoint(family: str, out_dir: Path, num_layers: int = 2, seed: int = 0) -> Path:
    import transformers

    spec = dict(FAMILIES[family])
    tok = build_tokenizer(out_dir)
    cfg_cls = getattr(transformers, spec.pop("cls"))
    spec.setdefault("intermediate_size", 128)
    spec.setdefault("num_hidden_layers", num_layers)
    cfg = cfg_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=spec.pop("num_attention_heads", 4),
        num_key_value_heads=spec.pop("num_key_value_heads", 2),
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **spec,
    )
    return save_random_model(cfg, out_dir, seed)


def save_random_model(cfg, out_dir: Path, seed: int = 0) -> Path:
    """transformers' model for `cfg` in fp32 with the tests' random weights, saved to out_dir."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the 0.02 default, so greedy choices are not near-ties
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and stacked expert matrices
                p.normal_(0, 0.08)
            elif name.endswith("sinks"):  # GPT-OSS: sink logits as large as the scores, so they matter
                p.normal_(0.5, 1.0)
            elif name.endswith("_bias") or ".router." in name:  # GPT-OSS's expert and router biases
                p.normal_(0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: as large as the sigmoid scores' spread
                b.normal_(0, 0.1)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {f: build_checkpoint(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> Path:
    return checkpoints["llama"]


@pytest.fixture(params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _fresh_dynamo_caches():
    """Every family's forward is one code object (models/decoder.py's shell), and Dynamo keeps at most
    8 compiled entries per code object: a test process that torch.compiles many tiny models would
    hit that limit (a hard failure under fullgraph) in whichever test came ninth. A server compiles
    one model; each test starts from Dynamo's empty caches as a server does."""
    import torch

    torch._dynamo.reset()
    yield
