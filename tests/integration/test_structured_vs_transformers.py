"""Greedy float32 structured output of the engine equals transformers `generate(do_sample=False)`
with xgrammar's own Hugging Face logits processor, token for token, for a JSON schema, a regex,
a choice and an EBNF grammar, on tiny random Llama / Qwen2 / Mistral models and on the default
model (chat prompts).

The reference is built from xgrammar's public API alone (its GrammarCompiler over
`TokenizerInfo.from_huggingface(tokenizer, vocab_size=model vocab, stop_token_ids=[eos])`), not
from the engine's spec-to-grammar code. It is made fair on two points of the processor's
semantics: generation stops at the eos (`eos_token_id`), which the grammar allows only where it
may end, as the engine stops on the eos its grammar accepted; and a new processor is made for
every `generate` call (it keeps its matchers across calls).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams as SOP

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"(yes|no), [a-z]{1,8}\."
CHOICES = ["Paris", "London", "Berlin"]
EBNF = 'root ::= "[" num ("," num){0,2} "]"\nnum ::= [1-9] [0-9]{0,2}'


@dataclass(frozen=True)
class Case:
    name: str
    engine: SOP
    reference: Callable[[Any, bool], Any]  # (xgrammar.GrammarCompiler, any_whitespace) -> compiled


CASES = [
    Case("json", SOP(json=SCHEMA),
         lambda c, ws: c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=ws)),
    Case("regex", SOP(regex=REGEX), lambda c, ws: c.compile_regex(REGEX)),
    Case("choice", SOP(choice=CHOICES),
         lambda c, ws: c.compile_grammar('root ::= "Paris" | "London" | "Berlin"')),
    Case("ebnf", SOP(grammar=EBNF), lambda c, ws: c.compile_grammar(EBNF)),
]


_COMPILERS: dict[tuple[bytes, int, int], Any] = {}


def grammar_compiler(tokenizer: Any, path: Path, vocab_size: int, eos: int) -> Any:
    """xgrammar's compiler for this tokenizer (the tiny models share the default model's)."""
    import xgrammar as xgr

    key = (hashlib.sha256((path / "tokenizer.json").read_bytes()).digest(), vocab_size, eos)
    if key not in _COMPILERS:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=[eos])
        _COMPILERS[key] = xgr.GrammarCompiler(info)
    return _COMPILERS[key]


class Reference:
    """transformers' greedy generate under xgrammar's logits processor, for one model folder."""

    def __init__(self, path: Path) -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).eval()
        self.eos = self.model.config.eos_token_id
        self.compiler = grammar_compiler(self.tokenizer, path, self.model.config.vocab_size,
                                         self.eos)

    def generate(self, case: Case, prompt: list[int], max_new: int, any_whitespace: bool) -> list[int]:
        from xgrammar.contrib.hf import LogitsProcessor

        processor = LogitsProcessor(case.reference(self.compiler, any_whitespace))  # one per call
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                logits_processor=[processor], eos_token_id=self.eos, pad_token_id=self.eos)
        return list(out[0, len(prompt):].tolist())


def compare(path: Path, prompts: dict[str, list[list[int]]], max_new: int,
            any_whitespace: bool) -> None:
    """Engine (one batch of every case's prompts) vs the reference (each prompt alone)."""
    reference = Reference(path)
    threads = 2 if (path / "model.safetensors").stat().st_size > 100e6 else 1
    with LLM(model=str(path), num_threads=threads) as llm:
        params = [SamplingParams(temperature=0.0, max_tokens=max_new, structured_outputs=SOP(
            **{case.engine.kind: getattr(case.engine, case.engine.kind)},
            disable_any_whitespace=not any_whitespace)) for case in CASES]
        batch = [(case, p, sp) for case, sp in zip(CASES, params, strict=True)
                 for p in prompts[case.name]]
        outs = llm.generate([p for _, p, _ in batch], [sp for *_, sp in batch], use_tqdm=False)
        stats = llm.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    for (case, prompt, _), out in zip(batch, outs, strict=True):
        want = reference.generate(case, prompt, max_new, any_whitespace)
        got = list(out.outputs[0].token_ids)
        assert got == want, (f"{case.name}: engine {reference.tokenizer.decode(got)!r} != "
                             f"transformers {reference.tokenizer.decode(want)!r}")
        if want[-1] == reference.eos:
            assert out.outputs[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def tiny_prompts() -> Iterator[list[list[int]]]:
    yield [[5, 6, 7, 8], [1000, 2000, 3000, 4000, 5000, 6000, 7000], [321] * 20]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tiny_models_match_transformers_with_xgrammar(
        arch: str, tiny_model_dir: Callable[[str], Path], tiny_prompts: list[list[int]]) -> None:
    # no free whitespace in JSON: a random model would write it until max_tokens
    compare(tiny_model_dir(arch), {c.name: tiny_prompts for c in CASES}, max_new=40,
            any_whitespace=False)


ASK = {
    "json": "Describe a person as JSON with a name, an age and tags.",
    "regex": "Is water wet? Answer yes or no, then one word.",
    "choice": "What is the capital of France?",
    "ebnf": "Give me up to three numbers as a list.",
}


@pytest.mark.slow  # ~65 s on 2 cores: the tiny models run by default
def test_the_default_model_matches_transformers_with_xgrammar(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)

    def chat(question: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": question}],
                                       add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    compare(default_model_dir, {name: [chat(q)] for name, q in ASK.items()}, max_new=48,
            any_whitespace=True)
