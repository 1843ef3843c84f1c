"""Mixture-of-experts models: Mixtral (top-2 of 8, weights renormalised), Qwen2-MoE (softmax
top-k with `norm_topk_prob`, a shared expert behind a sigmoid gate, q/k/v bias) and Qwen3-MoE
(Qwen3's q/k norms, no shared expert). The Qwen ones may keep some layers dense
(`mlp_only_layers`, `decoder_sparse_step`)."""

from __future__ import annotations

from typing import Any

from engine.model.arch import ArchOptions, MoeOptions, base_options, moe_layer_flags


def mixtral(config: Any) -> ArchOptions:
    moe = MoeOptions(num_experts=int(config.num_local_experts),
                     top_k=int(config.num_experts_per_tok),
                     intermediate_size=int(config.intermediate_size), norm_topk_prob=True)
    return base_options(config, moe=moe, moe_layers=(True,) * int(config.num_hidden_layers))


def _qwen_moe(config: Any, shared: bool) -> MoeOptions:
    return MoeOptions(
        num_experts=int(config.num_experts), top_k=int(config.num_experts_per_tok),
        intermediate_size=int(config.moe_intermediate_size),
        norm_topk_prob=bool(config.norm_topk_prob),
        shared_intermediate_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        if shared else 0,
        shared_expert_gate=shared)


def qwen2_moe(config: Any) -> ArchOptions:
    return base_options(config, qkv_bias=True, o_bias=False, moe=_qwen_moe(config, shared=True),
                        moe_layers=moe_layer_flags(config))


def qwen3_moe(config: Any) -> ArchOptions:
    return base_options(config, qk_norm=True, moe=_qwen_moe(config, shared=False),
                        moe_layers=moe_layer_flags(config))


ARCHITECTURES = {"MixtralForCausalLM": mixtral, "Qwen2MoeForCausalLM": qwen2_moe,
                 "Qwen3MoeForCausalLM": qwen3_moe}
