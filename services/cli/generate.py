"""`pdserve generate`: completions offline, printed."""

from __future__ import annotations

import argparse
import json
from typing import Any

from services.cli.engine_args import add_engine_args, engine_kwargs


def add_generate(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate completions offline and print them")
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for several)")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per completion instead of plain text")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens, stop=args.stop,
        ignore_eos=args.ignore_eos)
    llm = LLM(**engine_kwargs(args))
    try:
        if args.chat:
            system = [{"role": "system", "content": args.system}] if args.system else []
            outputs = llm.chat([[*system, {"role": "user", "content": p}] for p in args.prompt],
                               params, use_tqdm=False)
        else:
            outputs = llm.generate(list(args.prompt), params, use_tqdm=False)
    finally:
        llm.shutdown()
    many = len(outputs) > 1 or args.n > 1
    for i, out in enumerate(outputs):
        for sample in out.outputs:
            if args.json:
                print(json.dumps({"prompt_index": i, "index": sample.index, "text": sample.text,
                                  "token_ids": list(sample.token_ids),
                                  "finish_reason": sample.finish_reason}))
                continue
            if many:
                print(f"=== prompt {i}, sample {sample.index} ===")
            print(sample.text)
    return 0
