"""Disaggregated TTFT, split (issue #5): a producer engine prefills a prompt and saves its KV
to a `pdserve kvstore` process; a consumer engine loads it and computes the first decode step.
Per prompt length (256, 1,024, 2,048 tokens) and per transfer mode, in one run:
- prefill compute: the producer's time to its first token minus its waits for saves;
- save tail: what the producer waited for saves after the forward (per-layer streaming sends
  each layer while the next ones compute; whole-request sends everything after the last layer);
- load: the consumer's load of every layer;
- first decode step: the consumer's time to its first token minus the load (with layer-wise
  loads, which overlap that step, its whole time to first token).
Target: (save tail + load) <= 10% of prefill compute at 1,024 tokens and above (streaming).
Default model, float32, 2 threads; medians of the repeats, fresh prompts each time.

    python benchmarks/bench_connector.py [--repeats 3] [--lengths 256,1024,2048]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    markdown_table,
    median,
    random_token_ids,
    resolve_model_folder,
    set_threads,
    vocab_size,
)
from benchmarks.kvstore_process import StoreProcess
from engine.config import DEFAULT_MODEL


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--lengths", default="256,1024,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--integrity", choices=["off", "on"], default="on",
                   help="on: keyed BLAKE3 checksums put by the producer and verified by the consumer "
                        "(as deployed with PDSERVE_KV_INTEGRITY_KEY); off: none")
    return p.parse_args(argv)


def engine(folder: Path, url: str, role: str, stream: bool, threads: int,
           load_mode: str = "async", integrity: bool = True) -> Any:
    from engine.llm import LLM
    from kvstore.integrity import derive_key

    llm = LLM(model=str(folder), num_threads=threads, kv_cache_gib=0.5, max_num_batched_tokens=2048,
              kv_connector="kvstore", kv_role=role, kv_store_url=url, kv_stream_layers=stream,
              kv_load_mode=load_mode, enable_prefix_caching=False)
    worker: Any = llm.engine_core.runner.connector
    worker.integrity_checks = integrity
    worker.integrity_key = derive_key("bench") if integrity else None
    return llm


def one(producer: Any, consumer: Any, prompt: list[int]) -> dict[str, float]:
    from engine.sampling_params import SamplingParams

    pw = producer.engine_core.runner.connector
    cw = consumer.engine_core.runner.connector
    waits_before = len(pw.timings.save_waits)
    pre = producer.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                                     kv_transfer_params={"do_remote_decode": True}),
                            use_tqdm=False)[0]
    ttft_p = pre.metrics.first_token_time - pre.metrics.arrival_time
    tail = sum(pw.timings.save_waits[waits_before:])
    first = pre.outputs[0].token_ids[0]
    dec = consumer.generate([[*prompt, first]], SamplingParams(
        temperature=0, max_tokens=1, ignore_eos=True, kv_transfer_params=pre.kv_transfer_params),
        use_tqdm=False)[0]
    assert dec.num_cached_tokens == len(prompt), "the consumer did not load the prompt"
    ttft_c = dec.metrics.first_token_time - dec.metrics.arrival_time
    load = list(cw.timings.loads.values())[-1]  # this request's (one load at a time here)
    layerwise = consumer.engine_core.config.kv_load_mode == "layerwise"
    # Layer-wise loads overlap the first step: its time is the consumer's whole TTFT.
    first_step = ttft_c if layerwise else ttft_c - load
    return {"compute": ttft_p - tail, "tail": tail, "load": load, "first": first_step,
            "ttft": ttft_p + ttft_c}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    folder = resolve_model_folder(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    vocab = vocab_size(folder)
    rows = []
    with StoreProcess() as store:
        modes = [(True, "async", "per-layer streaming"), (False, "async", "whole request"),
                 (True, "layerwise", "streaming + layer-wise load")]
        for stream, load_mode, label in modes:
            on = args.integrity == "on"
            producer = engine(folder, store.url, "kv_producer", stream, args.threads, integrity=on)
            consumer = engine(folder, store.url, "kv_consumer", stream, args.threads, load_mode, on)
            one(producer, consumer, random_token_ids_seeded(64, 999, vocab))  # warm-up
            for n in lengths:
                runs = [one(producer, consumer, random_token_ids_seeded(n, 1000 * r + n + stream, vocab))
                        for r in range(args.repeats)]
                m = {k: median([r[k] for r in runs]) for k in runs[0]}
                share = (m["tail"] + m["load"]) / m["compute"]
                rows.append([label, n,
                             f"{m['compute'] * 1e3:.0f}", f"{m['tail'] * 1e3:.1f}",
                             f"{m['load'] * 1e3:.1f}", f"{m['first'] * 1e3:.1f}",
                             f"{m['ttft'] * 1e3:.0f}", f"{share:.3f}",
                             ("ok" if share <= 0.10 else "MISS")
                             if label == "per-layer streaming" and n >= 1024 else "-"])
            producer.engine_core.shutdown()
            consumer.engine_core.shutdown()
    print(f"disaggregated TTFT split: model {folder.name}, fp32, {args.threads} threads, kvstore "
          f"process on loopback; median of {args.repeats}; KV checksums {args.integrity}; "
          f"target (tail + load) / compute <= 0.10")
    print(markdown_table(["transfer", "prompt tokens", "prefill compute ms", "save tail ms",
                          "load ms", "first decode step ms", "TTFT ms", "(tail+load)/compute",
                          "target"], rows))
    return 0


def random_token_ids_seeded(n: int, seed: int, vocab: int = 49152) -> list[int]:
    import numpy as np

    return random_token_ids(np.random.default_rng(seed), n, vocab)


if __name__ == "__main__":
    raise SystemExit(main())
