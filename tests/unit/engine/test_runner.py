"""ModelRunner driven by hand-built SchedulerOutputs; greedy tokens checked against HF."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import transformers

from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from engine.model.causal_lm import CausalLM
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def hf_model() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
        pad_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model(hf_model: Any) -> CausalLM:
    ours = CausalLM(hf_model.config, TorchAttentionBackend(), torch.float32)
    ours.load_weights(hf_model.state_dict().items())
    return ours


def _runner(model: CausalLM, eos: int | None = None) -> ModelRunner:
    return ModelRunner(model, BLOCK, num_blocks=128, max_num_seqs=8, max_model_len=128,
                       max_num_batched_tokens=64, dtype=torch.float32,
                       device=torch.device("cpu"), eos_token_id=eos, seed=0)


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)
    return out[0, len(prompt):].tolist()


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randint(0, 128, (length,), generator=g).tolist()


class MiniScheduler:
    """Just enough scheduler to drive the runner: block ids, computed counts, new/cached."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.next_block = 1  # 0 is the null block; ids are never reused, so resumes move
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.params: dict[str, SamplingParams] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.send_full: set[str] = set()
        self.finished: set[str] = set()
        self.outputs: dict[str, list[int]] = {}

    def add(self, req_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> None:
        self.tokens[req_id], self.prompt_len[req_id] = list(prompt), len(prompt)
        self.params[req_id], self.blocks[req_id], self.computed[req_id] = params, [], 0
        self.send_full.add(req_id)
        self.outputs[req_id] = []

    def preempt(self, req_id: str) -> None:
        self.blocks[req_id], self.computed[req_id] = [], 0
        self.send_full.add(req_id)

    def finish(self, req_id: str) -> None:
        self.finished.add(req_id)

    def step(self, plan: dict[str, int]) -> ModelRunnerOutput:
        new_reqs, cached_reqs = [], []
        for req_id, n in plan.items():
            need = math.ceil((self.computed[req_id] + n) / BLOCK) - len(self.blocks[req_id])
            fresh = list(range(self.next_block, self.next_block + max(need, 0)))
            self.next_block += len(fresh)
            self.blocks[req_id] += fresh
            if req_id in self.send_full:
                self.send_full.discard(req_id)
                new_reqs.append(NewRequestData(
                    req_id, list(self.tokens[req_id]), self.prompt_len[req_id],
                    self.params[req_id], [list(self.blocks[req_id])], self.computed[req_id]))
            else:
                cached_reqs.append(CachedRequestData(req_id, [fresh], self.computed[req_id]))
        so = SchedulerOutput(new_reqs, cached_reqs, dict(plan), sum(plan.values()),
                             self.finished)
        self.finished = set()
        out = self.runner.execute_model(so)
        assert out.req_ids == list(plan)
        for req_id, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            self.computed[req_id] += plan[req_id]
            self.tokens[req_id] += toks
            self.outputs[req_id] += toks
        return out

    def decode(self, req_ids: list[str], steps: int) -> None:
        for _ in range(steps):
            self.step({r: 1 for r in req_ids})


def test_whole_prefill_then_decodes_match_hf_greedy(model: CausalLM, hf_model: Any) -> None:
    sched = MiniScheduler(_runner(model))
    prompt = _prompt(1, 13)
    sched.add("a", prompt)
    out = sched.step({"a": 13})
    assert len(out.sampled_token_ids[0]) == 1
    sched.decode(["a"], 7)
    assert sched.outputs["a"] == _hf_greedy(hf_model, prompt, 8)


def test_chunked_prefill_samples_only_after_last_chunk(model: CausalLM, hf_model: Any) -> None:
    sched = MiniScheduler(_runner(model))
    prompt = _prompt(2, 11)
    sched.add("a", prompt)
    assert sched.step({"a": 6}).sampled_token_ids == [[]]
    assert len(sched.step({"a": 5}).sampled_token_ids[0]) == 1
    sched.decode(["a"], 5)
    assert sched.outputs["a"] == _hf_greedy(hf_model, prompt, 6)


def test_mixed_batch_of_prefill_chunk_and_decodes_matches_hf(model: CausalLM, hf_model: Any) -> None:
    sched = MiniScheduler(_runner(model))
    prompts = {"a": _prompt(3, 9), "b": _prompt(4, 17), "c": _prompt(5, 5)}
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt)
    sched.step({"a": 9})  # a: whole prefill
    out = sched.step({"a": 1, "b": 10, "c": 5})  # a decodes, b chunk, c whole prefill
    assert [len(t) for t in out.sampled_token_ids] == [1, 0, 1]
    sched.step({"b": 7, "c": 1, "a": 1})  # batch order differs from arrival order
    sched.decode(["c", "a", "b"], 4)
    for req_id, prompt in prompts.items():
        n = len(sched.outputs[req_id])
        assert sched.outputs[req_id] == _hf_greedy(hf_model, prompt, n), req_id


def test_preempted_request_resumes_with_new_blocks(model: CausalLM, hf_model: Any) -> None:
    runner = _runner(model)
    sched = MiniScheduler(runner)
    prompt = _prompt(6, 10)
    sched.add("a", prompt)
    sched.add("b", _prompt(7, 6))
    sched.step({"a": 10, "b": 6})
    sched.decode(["a", "b"], 3)
    old_blocks = list(sched.blocks["a"])
    sched.preempt("a")
    sched.runner.kv_caches[0][old_blocks] = 0.0  # its blocks are gone (maybe reused)
    sched.decode(["b"], 2)
    num_tokens = len(sched.tokens["a"])
    sched.step({"a": num_tokens})  # resumed: recompute everything, fresh block ids
    assert set(sched.blocks["a"]).isdisjoint(old_blocks)
    assert runner.requests["a"].block_ids == [sched.blocks["a"]]
    sched.decode(["a"], 3)
    assert sched.outputs["a"] == _hf_greedy(hf_model, prompt, len(sched.outputs["a"]))


def test_seeded_request_gives_same_tokens_alone_and_in_a_batch(model: CausalLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=64)
    prompt = _prompt(8, 12)

    alone = MiniScheduler(_runner(model))
    alone.add("s", prompt, seeded)
    alone.step({"s": 12})
    alone.decode(["s"], 6)

    batch = MiniScheduler(_runner(model))
    batch.add("x", _prompt(9, 7), SamplingParams(temperature=1.0, max_tokens=64))
    batch.add("s", prompt, seeded)
    batch.add("y", _prompt(10, 5), SamplingParams(temperature=0.5, seed=7, max_tokens=64))
    batch.step({"x": 7, "s": 5})
    batch.step({"y": 5, "s": 7, "x": 1})
    batch.decode(["y", "x", "s"], 3)
    batch.preempt("s")  # preemption keeps the request's generator
    batch.step({"s": len(batch.tokens["s"]), "x": 1})
    batch.decode(["s", "y"], 2)
    assert batch.outputs["s"] == alone.outputs["s"]


def test_finished_requests_are_dropped(model: CausalLM) -> None:
    runner = _runner(model)
    sched = MiniScheduler(runner)
    sched.add("a", _prompt(11, 4))
    sched.add("b", _prompt(12, 4))
    sched.step({"a": 4, "b": 4})
    sched.finish("a")
    sched.step({"b": 1})
    assert set(runner.requests) == {"b"}
    assert runner.requests["b"].output_token_ids == sched.outputs["b"]


def test_logprobs_are_returned_for_requests_that_ask(model: CausalLM, hf_model: Any) -> None:
    sched = MiniScheduler(_runner(model))
    prompt = _prompt(13, 8)
    sched.add("a", prompt, SamplingParams(temperature=0.0, logprobs=3))
    sched.add("b", _prompt(14, 8))
    out = sched.step({"a": 8, "b": 8})
    entries, none = out.logprobs
    assert none is None and entries is not None and len(entries) == 1
    entry = entries[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1].double(), -1)
    top = ref.topk(3)
    assert entry.token_ids == [out.sampled_token_ids[0][0], *top.indices.tolist()]
    assert entry.logprobs == pytest.approx([top.values[0].item(), *top.values.tolist()],
                                           abs=1e-4)
    assert entry.sampled_rank == 1


def test_min_tokens_keeps_eos_out_until_reached(model: CausalLM, hf_model: Any) -> None:
    prompt = _prompt(15, 6)
    eos = _hf_greedy(hf_model, prompt, 1)[0]  # the token greedy decoding would pick first
    sched = MiniScheduler(_runner(model, eos=eos))
    sched.add("a", prompt, SamplingParams(temperature=0.0, min_tokens=2))
    sched.step({"a": 6})
    assert sched.outputs["a"][0] != eos
