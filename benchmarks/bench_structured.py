"""Structured outputs (issue #20): what a JSON schema costs a served request.

The engine runs as a worker runs it: `AsyncLLM` with its core in a process of its own, requests
sent concurrently from asyncio. Default model, float32, 2 torch threads. In one run:
- throughput: 16 concurrent chat requests, each constrained to its own JSON schema (16
  realistic, bounded schemas: benchmarks/structured_workload.py), greedy, against the same 16
  prompts unconstrained. Each unconstrained request generates exactly as many tokens as its
  constrained twin did in a warm-up round (max_tokens = that count, ignore_eos), so both sides
  do the same model work and the difference is the grammar's (bitmask fill, bitmask apply,
  matcher advance). The warm-up also fills the prefix cache, so the timed rounds are mostly
  decode steps: the grammar's worst case. Output tok/s = generated tokens / the round's wall
  time; step ms = the core's mean step time. Target: structured / unconstrained tok/s >= 0.9.
  The same again seeded at temperature 1.0 (each request its own seed; the unconstrained twins
  seeded alike), reported beside it without a target: on CPU both kinds of row are masked only
  when the grammar refuses their unmasked choice, but a sampled row with top-k, top-p, min-p
  or logprobs is masked every step (docs/structured-outputs.md), so the sampled figure depends
  on those parameters.
- compile, in this process with the engine's own StructuredOutputManager: the front end's
  check of a schema (choose_backend), a new schema's compile, a cached one's start to ready, and
  the backend's start-up (the engine's first grammar: tokenizer vocabulary tables).
- TTFT (client side: the call to the output of a max_tokens=1 request) of one request alone on
  the idle engine: unconstrained, with a schema never compiled before (it compiles while the
  request waits), and with a schema compiled already. Each TTFT prompt starts with a tag of its
  own, so no prefix cache hit favours any of them.
Repeats interleave the settings (which goes first rotates), so noise from elsewhere hits all of
them; the table shows medians. The load average is printed before and after.

    python benchmarks/bench_structured.py [--repeats 5] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine_line, markdown_table, median, resolve_model_folder, set_threads
from benchmarks.structured_workload import TASKS, fresh_schema, messages
from engine.config import DEFAULT_MODEL

TARGET = 0.9  # structured / unconstrained output tok/s
_ids = itertools.count()


@dataclass
class Round:
    """One round of 16 concurrent requests."""

    wall_s: float
    tokens: list[int]  # generated tokens per request
    steps: int  # core steps that computed tokens
    step_s: float  # their total time
    texts: list[str] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)


@dataclass
class Results:
    # "structured", "unconstrained", "structured seeded", "unconstrained seeded"
    rounds: dict[str, list[Round]] = field(default_factory=lambda: defaultdict(list))
    ttft: dict[str, list[float]] = field(default_factory=lambda: {"unconstrained": [],
                                                                   "new schema": [],
                                                                   "cached schema": []})
    check_s: list[float] = field(default_factory=list)  # the front end's choose_backend
    compile_s: list[float] = field(default_factory=list)  # manager misses
    cached_s: list[float] = field(default_factory=list)  # start to ready, cache hits
    setup_s: float = float("nan")
    # "" (greedy) / " seeded" -> warm-up outputs that validate against their schema, and those
    # whose grammar ended (finish_reason "stop")
    valid: dict[str, int] = field(default_factory=dict)
    complete: dict[str, int] = field(default_factory=dict)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or local HF folder")
    p.add_argument("--num-requests", type=int, default=16, help="concurrent requests (<= 16)")
    p.add_argument("--max-tokens", type=int, default=160, help="bound of a constrained output")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads of the core")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a round may take")
    return p.parse_args(argv)


def structured(schema: dict[str, Any], max_tokens: int, seed: int | None = None) -> Any:
    """Greedy, or with a seed temperature 1.0."""
    from engine.sampling_params import RequestOutputKind, SamplingParams
    from engine.structured.params import StructuredOutputsParams

    return SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=max_tokens,
                          output_kind=RequestOutputKind.FINAL_ONLY,
                          structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))


def unconstrained(num_tokens: int, seed: int | None = None) -> Any:
    """Exactly `num_tokens` tokens: ignore_eos with max_tokens, not min_tokens (which bans EOS
    through the sampler's full pipeline, a per-step cost the constrained side does not pay)."""
    from engine.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=num_tokens,
                          ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


async def final_output(llm: Any, prompt: str, params: Any) -> Any:
    last = None
    async for out in llm.generate(prompt, params, f"bench-{next(_ids)}"):
        last = out
    return last


async def run_round(llm: Any, prompts: list[str], params: list[Any], timeout: float) -> Round:
    before = (await llm.get_stats()).step_seconds
    start = time.perf_counter()
    outs = await asyncio.wait_for(
        asyncio.gather(*(final_output(llm, p, sp) for p, sp in zip(prompts, params, strict=True))),
        timeout)
    wall = time.perf_counter() - start
    after = (await llm.get_stats()).step_seconds
    return Round(wall, [len(o.outputs[0].token_ids) for o in outs], after.count - before.count,
                 after.total - before.total, [o.outputs[0].text for o in outs],
                 [o.outputs[0].finish_reason for o in outs])


async def ttft(llm: Any, prompt: str, params: Any, timeout: float) -> float:
    start = time.perf_counter()
    await asyncio.wait_for(final_output(llm, prompt, params), timeout)
    return time.perf_counter() - start


def count_valid(texts: list[str], schemas: list[dict[str, Any]]) -> int:
    """Outputs that parse as JSON and validate against their schema."""
    import jsonschema

    valid = 0
    for text, schema in zip(texts, schemas, strict=True):
        try:
            jsonschema.validate(json.loads(text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid


def measure_compile(folder: Path, results: Results) -> None:
    """The engine's manager in this process: setup, then each task schema new, then cached."""
    from engine.structured.manager import StructuredOutputManager
    from engine.structured.params import StructuredOutputsParams
    from engine.structured.select import choose_backend

    config = json.loads((folder / "config.json").read_text())
    eos = config.get("eos_token_id")
    manager = StructuredOutputManager(str(folder), int(config["vocab_size"]),
                                      eos[0] if isinstance(eos, list) else eos)
    try:
        start = time.perf_counter()
        manager.start(StructuredOutputsParams(json_object=True)).future.result(timeout=300)
        results.setup_s = time.perf_counter() - start
        specs = []
        for _, schema in TASKS:
            start = time.perf_counter()
            specs.append(choose_backend(StructuredOutputsParams(json=json.dumps(schema))))
            results.check_s.append(time.perf_counter() - start)
        for spec in specs:
            manager.start(spec).future.result(timeout=300)
        results.compile_s = list(manager.stats.compile_seconds[1:])  # not the setup's grammar
        for spec in specs:
            start = time.perf_counter()
            manager.start(spec).future.result(timeout=300)
            results.cached_s.append(time.perf_counter() - start)
    finally:
        manager.shutdown()


def chat_prompt(tokenizer: Any, task: str, tag: str = "") -> str:
    msgs = messages(task)
    if tag:
        msgs[0]["content"] = f"[{tag}] {msgs[0]['content']}"
    return str(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


async def measure_engine(folder: Path, args: argparse.Namespace, results: Results) -> None:
    from engine.async_llm import AsyncLLM
    from engine.config import EngineConfig

    config = EngineConfig(model=str(folder), dtype="float32", num_threads=args.threads,
                          kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len)
    llm = AsyncLLM(config)
    try:
        tasks = TASKS[: args.num_requests]
        prompts = [chat_prompt(llm.get_tokenizer(), task) for task, _ in tasks]
        settings: dict[str, list[Any]] = {}
        for kind in ("", " seeded"):
            seeds: list[int | None] = [None] * len(tasks) if not kind else list(range(len(tasks)))
            cons = [structured(schema, args.max_tokens, seed)
                    for (_, schema), seed in zip(tasks, seeds, strict=True)]
            warm = await run_round(llm, prompts, cons, args.timeout)  # compiles, caches the prompts
            results.valid[kind] = count_valid(warm.texts, [s for _, s in tasks])
            results.complete[kind] = warm.finish.count("stop")
            free = [unconstrained(max(1, n), seed) for n, seed in zip(warm.tokens, seeds, strict=True)]
            await run_round(llm, prompts, free, args.timeout)
            settings[f"structured{kind}"], settings[f"unconstrained{kind}"] = cons, free
        for r in range(args.repeats):
            names = list(settings)
            for name in names[r % 4:] + names[: r % 4]:
                results.rounds[name].append(await run_round(llm, prompts, settings[name], args.timeout))
        await measure_ttft(llm, args, results)
    finally:
        await llm.close()


async def measure_ttft(llm: Any, args: argparse.Namespace, results: Results) -> None:
    tokenizer = llm.get_tokenizer()
    await ttft(llm, chat_prompt(tokenizer, TASKS[0][0], "warm"), unconstrained(1), args.timeout)
    nonce = os.urandom(4).hex()
    for r in range(args.repeats):
        task, schema = TASKS[r % min(args.num_requests, len(TASKS))]  # compiled in the warm-up
        kinds = {"unconstrained": unconstrained(1),
                 "new schema": structured(fresh_schema(f"{nonce}_{r}"), 1),
                 "cached schema": structured(schema, 1)}
        names = list(kinds)
        for name in names[r % 3:] + names[: r % 3]:
            prompt = chat_prompt(tokenizer, task, f"{nonce} {r} {name}")
            results.ttft[name].append(await ttft(llm, prompt, kinds[name], args.timeout))


def report_rows(results: Results, num_requests: int) -> list[list[object]]:
    nan = float("nan")
    rows: list[list[object]] = []
    for kind in ("", " seeded"):
        s, u = results.rounds[f"structured{kind}"], results.rounds[f"unconstrained{kind}"]
        tok_s = [median([sum(x.tokens) / x.wall_s for x in rounds]) for rounds in (s, u)]
        step_ms = [median([x.step_s / max(1, x.steps) * 1e3 for x in rounds]) for rounds in (s, u)]
        ratio = tok_s[0] / tok_s[1]
        label = "greedy" if not kind else "seeded T=1"
        target = [f">= {TARGET}", "ok" if ratio >= TARGET else "MISS"] if not kind else ["", ""]
        rows += [[f"output tok/s, {num_requests} concurrent, {label}", tok_s[0], tok_s[1], ratio,
                  *target],
                 [f"mean step ms, {num_requests} concurrent, {label}", step_ms[0], step_ms[1],
                  step_ms[0] / step_ms[1], "", ""]]
    t = {k: median(v) * 1e3 for k, v in results.ttft.items()}
    return [
        *rows,
        ["TTFT ms, new schema", t["new schema"], t["unconstrained"],
         t["new schema"] / t["unconstrained"], "", ""],
        ["TTFT ms, cached schema", t["cached schema"], t["unconstrained"],
         t["cached schema"] / t["unconstrained"], "", ""],
        ["schema check ms (front end)", median(results.check_s) * 1e3, nan, nan, "", ""],
        ["compile ms, new schema", median(results.compile_s) * 1e3, nan, nan, "", ""],
        ["start to ready ms, cached schema", median(results.cached_s) * 1e3, nan, nan, "", ""],
        ["backend start-up ms (first grammar)", results.setup_s * 1e3, nan, nan, "", ""],
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not 1 <= args.num_requests <= len(TASKS) or args.repeats < 1:
        raise SystemExit(f"--num-requests must be in 1..{len(TASKS)}, --repeats >= 1")
    set_threads(args.threads)
    folder = resolve_model_folder(args.model)
    load_before = os.getloadavg()
    results = Results()
    measure_compile(folder, results)
    asyncio.run(measure_engine(folder, args, results))
    print(f"structured outputs: {args.num_requests} concurrent chat requests, one JSON schema each "
          f"(max_tokens {args.max_tokens}), against the same prompts unconstrained with the same "
          f"token counts; greedy, and seeded at temperature 1.0; fp32, model {folder.name}, "
          f"AsyncLLM (core in its own process); median of {args.repeats} interleaved repeats")
    for kind in ("", " seeded"):
        s, u = results.rounds[f"structured{kind}"], results.rounds[f"unconstrained{kind}"]
        print(f"{kind.strip() or 'greedy'}: tokens per round: structured {sum(s[-1].tokens)}, "
              f"unconstrained {sum(u[-1].tokens)}; outputs valid against their schema: "
              f"{results.valid[kind]}/{args.num_requests} (grammar ended: "
              f"{results.complete[kind]}/{args.num_requests})")
    print(machine_line(args.threads, None) + f"; load average {_load(load_before)} before, "
          f"{_load(os.getloadavg())} after (other processes skew the times)")
    headers = ["measure", "structured", "unconstrained", "ratio", "target", "verdict"]
    print(markdown_table(headers, report_rows(results, args.num_requests)))
    return 0


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


if __name__ == "__main__":
    sys.exit(main())
