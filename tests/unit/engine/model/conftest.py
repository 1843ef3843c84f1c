"""Helpers for the model tests: tiny random HF models and a hand-made paged-KV driver."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.llama import LlamaForCausalLM

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
}


def make_hf_model(name: str, seed: int = 0) -> Any:
    """A random float32 transformers model; biases and norm weights perturbed so that a
    loader which drops them fails."""
    config = TINY_CONFIGS[name]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in pname:
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def make_our_model(hf_model: Any) -> LlamaForCausalLM:
    ours = LlamaForCausalLM(hf_model.config, TorchAttentionBackend(), dtype=torch.float32)
    ours.load_weights(hf_model.state_dict().items())
    return ours.eval()


class PagedDriver:
    """Drives our model like a runner would: a tiny block allocator with shuffled block ids
    (never block 0), per-request block tables, one varlen batch per `step`."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 96, block_size: int = 4,
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
def model_pair(request: pytest.FixtureRequest) -> tuple[Any, LlamaForCausalLM]:
    """(transformers reference model, our model with its weights), one per tiny config."""
    hf_model = make_hf_model(request.param)
    return hf_model, make_our_model(hf_model)
