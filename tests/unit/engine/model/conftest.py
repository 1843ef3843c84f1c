"""Helpers for the model tests: tiny random HF models and a hand-made paged-KV driver."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.causal_lm import CausalLM

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

TINY_CONFIGS: dict[str, Any] = {
    "llama_tied": lambda: LlamaConfig(**_COMMON, vocab_size=256, tie_word_embeddings=True),
    "llama_untied_gqa1": lambda: LlamaConfig(
        **{**_COMMON, "num_key_value_heads": 4}, vocab_size=300, tie_word_embeddings=False),
    "llama_llama3_rope": lambda: LlamaConfig(
        **_COMMON, vocab_size=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}),
    "llama_linear_rope": lambda: LlamaConfig(
        **_COMMON, vocab_size=256, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}),
    "llama_yarn_rope": lambda: LlamaConfig(
        **_COMMON, vocab_size=256, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64}),
    "qwen2_bias": lambda: Qwen2Config(
        **{**_COMMON, "num_key_value_heads": 1}, vocab_size=512, tie_word_embeddings=False),
    "mistral": lambda: MistralConfig(
        **_COMMON, head_dim=16, vocab_size=384, tie_word_embeddings=False),
    # Windows of 8 keys against prompts of up to 30 tokens in blocks of 4: blocks leave the window.
    "mistral_window": lambda: MistralConfig(
        **_COMMON, vocab_size=256, tie_word_embeddings=False, sliding_window=8),
    "qwen3": lambda: Qwen3Config(  # explicit head_dim: heads * head_dim != hidden_size
        **_COMMON, head_dim=24, vocab_size=256, tie_word_embeddings=True),
    "qwen3_window_bias": lambda: Qwen3Config(  # layers 1 and 2 windowed (max_window_layers 1)
        **_COMMON, vocab_size=256, tie_word_embeddings=False, attention_bias=True,
        use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "mixtral": lambda: MixtralConfig(
        **_COMMON, vocab_size=256, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen2_moe": lambda: Qwen2MoeConfig(  # shared expert, unnormalised top-k, layer 1 dense
        **_COMMON, vocab_size=256, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_COMMON, head_dim=16, vocab_size=256, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False),
    "gemma2": lambda: Gemma2Config(
        **_COMMON, head_dim=16, vocab_size=256, query_pre_attn_scalar=24, sliding_window=8,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": lambda: Gemma3TextConfig(
        **_COMMON, head_dim=16, vocab_size=256, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                            "factor": 8.0}}),
    "phi3_partial_longrope": lambda: Phi3Config(  # Phi-4-mini's shape; long set past 64
        **_COMMON, vocab_size=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                         "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}),
}


def make_hf_model(name: str, seed: int = 0) -> Any:
    """A random float32 transformers model; biases and norm weights perturbed so that a
    loader which drops them fails."""
    config = TINY_CONFIGS[name]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.std() == 0 and "norm" not in pname:  # e.g. a router left at zeros
                param.normal_(0.0, 0.2)
            if pname.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in pname:
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def make_our_model(hf_model: Any) -> CausalLM:
    ours = CausalLM(hf_model.config, TorchAttentionBackend(), dtype=torch.float32)
    ours.load_weights(hf_model.state_dict().items())
    return ours.eval()


class PagedDriver:
    """Drives our model like a runner would: a tiny block allocator with shuffled block ids
    (never block 0), per-request block tables, one varlen batch per `step`."""

    def __init__(self, model: CausalLM, num_blocks: int = 96, block_size: int = 4,
                 seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        shape = (num_blocks, 2, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(model.num_layers)]
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, batch: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """Feeds each request its new tokens; returns each request's logits [n_new, vocab]."""
        ids, positions, slots, q_lens, s_lens = [], [], [], [], []
        for rid, tokens in batch:
            start = self.lens.get(rid, 0)
            blocks = self.blocks.setdefault(rid, [])
            while len(blocks) * self.block_size < start + len(tokens):
                blocks.append(self.free.pop())
            for p, tok in enumerate(tokens, start):
                ids.append(tok)
                positions.append(p)
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
            self.lens[rid] = start + len(tokens)
            q_lens.append(len(tokens))
            s_lens.append(start + len(tokens))
        max_blocks = max(len(self.blocks[rid]) for rid, _ in batch)
        table = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        for i, (rid, _) in enumerate(batch):
            table[i, : len(self.blocks[rid])] = torch.tensor(self.blocks[rid])
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor(s_lens, dtype=torch.int32), block_table=table,
            max_query_len=max(q_lens), max_seq_len=max(s_lens),
            query_lens_cpu=q_lens, seq_lens_cpu=s_lens,
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, metadata)
            logits = self.model.compute_logits(hidden)
        return dict(zip([rid for rid, _ in batch], logits.split(q_lens), strict=True))


@pytest.fixture
def paged_driver() -> type[PagedDriver]:
    return PagedDriver


@pytest.fixture(params=sorted(TINY_CONFIGS))
def model_pair(request: pytest.FixtureRequest) -> tuple[Any, CausalLM]:
    """(transformers reference model, our model with its weights), one per tiny config."""
    hf_model = make_hf_model(request.param)
    return hf_model, make_our_model(hf_model)


@pytest.fixture
def tiny_config() -> Any:
    """`tiny_config(name)`: a fresh transformers config of one of TINY_CONFIGS."""
    return lambda name: TINY_CONFIGS[name]()


@pytest.fixture
def our_model_of() -> Any:
    """`our_model_of(hf_model)`: our model holding the transformers model's weights."""
    return make_our_model
