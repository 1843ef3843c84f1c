"""What each tensor-parallel rank holds (engine/parallel/shard.py): every rank's slices of a
checkpoint, put side by side, give the whole tensor back; a split the model does not allow is a
ValueError naming tensor_parallel_size. And the step channel (engine/parallel/channel.py) carries
a scheduler output across a process boundary unchanged."""

from __future__ import annotations

import multiprocessing
from dataclasses import replace
from typing import Any

import pytest
import torch

from engine.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from engine.model.arch import ArchOptions, MoeOptions
from engine.parallel.channel import StepChannel, StepMessage
from engine.parallel.shard import Shard
from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams

OPTS = ArchOptions(num_layers=1, hidden_size=8, vocab_size=11, num_heads=4, num_kv_heads=2, head_dim=2,
                   intermediate_size=12, norm_eps=1e-6, activation="silu", tie_word_embeddings=False,
                   windows=(None,), rope_layer_types=(None,), moe_layers=(True,),
                   moe=MoeOptions(num_experts=3, top_k=2, intermediate_size=6, norm_topk_prob=True,
                                  shared_intermediate_size=4, shared_expert_gate=True))


DENSE = replace(OPTS, moe=None, moe_layers=())


def _slices(name: str, tensor: torch.Tensor, tp: int, opts: ArchOptions = OPTS) -> list[torch.Tensor]:
    return [Shard(opts, r, tp).slice(name, tensor) for r in range(tp)]


@pytest.mark.parametrize(("name", "shape", "dim"), [
    ("model.layers.0.self_attn.q_proj.weight", (8, 8), 0),
    ("model.layers.0.self_attn.q_proj.bias", (8,), 0),
    ("model.layers.0.self_attn.o_proj.weight", (8, 8), 1),
    ("model.layers.0.mlp.gate_proj.weight", (12, 8), 0),
    ("model.layers.0.mlp.down_proj.weight", (8, 12), 1),
    ("model.layers.0.mlp.shared_expert.up_proj.weight", (4, 8), 0),
    ("model.layers.0.mlp.shared_expert.down_proj.weight", (8, 4), 1),
    ("model.layers.0.mlp.experts.2.up_proj.weight", (6, 8), 0),
    ("model.layers.0.block_sparse_moe.experts.1.w2.weight", (8, 6), 1),
    ("model.layers.0.mlp.experts.down_proj", (3, 8, 6), 2),
])
def test_the_ranks_slices_side_by_side_are_the_whole_tensor(name: str, shape: tuple[int, ...],
                                                             dim: int) -> None:
    tensor = torch.randn(shape)
    assert torch.equal(torch.cat(_slices(name, tensor, 2), dim=dim), tensor)


def test_fused_checkpoint_tensors_are_split_per_part() -> None:
    # Phi-3's qkv_proj (q 8 rows | k 4 | v 4) and gate_up_proj (gate 12 | up 12), transformers 5's
    # fused experts [E, 2I, H]
    qkv = torch.arange(16.0).unsqueeze(1)
    assert [s.flatten().tolist() for s in _slices("layers.0.self_attn.qkv_proj.weight", qkv, 2)] == [
        [0, 1, 2, 3, 8, 9, 12, 13], [4, 5, 6, 7, 10, 11, 14, 15]]
    gate_up = torch.arange(24.0).unsqueeze(1)
    assert [s.flatten().tolist() for s in _slices("layers.0.mlp.gate_up_proj.weight", gate_up, 2)] == [
        [*range(0, 6), *range(12, 18)], [*range(6, 12), *range(18, 24)]]
    experts = torch.arange(12.0).view(1, 12, 1)
    assert [s.flatten().tolist() for s in _slices("layers.0.mlp.experts.gate_up_proj", experts, 2)] == [
        [0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]


def test_kv_head_groups_split_unevenly_where_the_ranks_do_not_divide_them() -> None:
    """SmolLM2-135M's shape: 9 query heads in 3 KV groups on 2 ranks: 2 + 1 groups, 6 + 3 heads."""
    smol = replace(DENSE, num_heads=9, num_kv_heads=3, head_dim=1)
    ranks = [Shard(smol, r, 2) for r in range(2)]
    assert [(s.first_kv_head, s.kv_heads, s.first_head, s.heads) for s in ranks] == [
        (0, 2, 0, 6), (2, 1, 6, 3)]
    q, k = torch.arange(9.0).unsqueeze(1), torch.arange(3.0).unsqueeze(1)
    assert [s.slice("layers.0.self_attn.q_proj.weight", q).flatten().tolist() for s in ranks] == [
        [0, 1, 2, 3, 4, 5], [6, 7, 8]]
    assert [s.slice("layers.0.self_attn.k_proj.weight", k).flatten().tolist() for s in ranks] == [[0, 1], [2]]
    o = torch.arange(9.0).unsqueeze(0)
    assert torch.equal(torch.cat([s.slice("layers.0.self_attn.o_proj.weight", o) for s in ranks], dim=1), o)
    assert [(s.options().num_heads, s.options().num_kv_heads) for s in ranks] == [(6, 2), (3, 1)]


def test_kv_heads_fewer_than_ranks_are_replicated() -> None:
    k = torch.arange(4.0).unsqueeze(1)  # 2 KV heads of head_dim 2
    assert [s.flatten().tolist() for s in _slices("layers.0.self_attn.k_proj.weight", k, 4, DENSE)] == [
        [0, 1], [0, 1], [2, 3], [2, 3]]
    assert Shard(DENSE, 3, 4).options().num_kv_heads == 1


def test_vocab_rows_are_padded_on_the_last_rank_and_replicated_tensors_kept() -> None:
    embed = torch.randn(11, 8)
    parts = _slices("model.embed_tokens.weight", embed, 2)
    assert [p.shape[0] for p in parts] == [6, 6]
    assert torch.equal(torch.cat(parts)[:11], embed) and not parts[1][5].any()
    for name in ("model.norm.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.self_attn.o_proj.bias", "model.layers.0.self_attn.q_norm.weight",
                 "model.layers.0.mlp.shared_expert_gate.weight"):
        t = torch.randn(3, 8)
        assert Shard(OPTS, 1, 2).slice(name, t) is t
    local = Shard(OPTS, 0, 2).options()
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 6, 6)
    assert local.moe is not None
    assert (local.moe.intermediate_size, local.moe.shared_intermediate_size) == (3, 2)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_heads": 6}, "4 ranks for the model's 2 KV heads: with fewer KV heads than ranks, the "
                       "ranks must be a multiple of them and divide the 6 attention heads"),
    ({"num_kv_heads": 3, "num_heads": 12}, "4 ranks for the model's 3 KV heads"),
    ({"num_kv_heads": 3, "num_heads": 8}, "the model's 8 attention heads are not groups of its 3"),
    ({"intermediate_size": 10}, "4 does not divide the MLP's intermediate size 10"),
])
def test_a_split_the_model_does_not_allow_names_the_setting(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"tensor_parallel_size: {message}"):
        Shard(replace(DENSE, **change), 0, 4)


def _echo(reader: Any, conn: Any) -> None:
    conn.send(reader.recv(lambda: True))


def test_a_step_message_crosses_to_another_process_unchanged() -> None:
    params = SamplingParams(temperature=0.5, seed=3, stop=["x"], logit_bias={5: 1.5},
                            structured_outputs=StructuredOutputsParams(json='{"type": "object"}'))
    so = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3], 3, params, [[4, 5]], 0, "salt")],
        scheduled_cached_reqs=[CachedRequestData("b", [[9]], 17)],
        num_scheduled_tokens={"a": 3, "b": 1}, total_num_scheduled_tokens=4,
        finished_req_ids={"c", "d"}, preempted_req_ids={"e"}, structured_output_request_ids=["a"])
    ctx = multiprocessing.get_context("spawn")
    channel = StepChannel(ctx, readers=1, size=1 << 16)
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(channel.reader(0), theirs))
    proc.start()
    try:
        sent = StepMessage(scheduler_output=so, sampled={"b": [42, 43]})
        channel.send(sent, timeout_s=30)
        assert mine.poll(60)
        assert mine.recv() == sent
    finally:
        proc.join(timeout=30)
    with pytest.raises(ValueError, match="exceeds the tensor-parallel channel's 65536 bytes"):
        channel.send(StepMessage(sampled={str(i): [i] for i in range(20000)}), timeout_s=1)
