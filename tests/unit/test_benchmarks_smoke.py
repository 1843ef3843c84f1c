"""The benchmark scripts stay runnable: each `main` runs end to end on a tiny random model."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from benchmarks import bench_prefix_cache, bench_workload_a, check_memory
from benchmarks.common import ModelShape, markdown_table, workload_flops

VOCAB = 512


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with a word-level tokenizer of the same vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"t{i}": i for i in range(4, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", unk_token="<unk>").save_pretrained(path)
    return path


def table_rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows keyed by their first cell (header and rule lines skipped)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = cells[1:]
    return rows


def test_workload_flops_counts_dense_lm_head_and_attention_terms(tiny_model: Path) -> None:
    shape = ModelShape.from_folder(tiny_model)
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_model)
    non_embedding = sum(p.numel() for n, p in hf.named_parameters()
                        if "embed_tokens" not in n and "lm_head" not in n)
    assert shape.non_embedding_params == non_embedding
    # one prompt of 3 tokens + 2 new: 5 dense tokens, 2 sampled positions, contexts 1..5
    expected = 2 * non_embedding * 5 + 2 * VOCAB * 64 * 2 + 4 * 2 * 64 * 15
    assert workload_flops(shape, [3], 2) == expected


def test_markdown_table_aligns_columns_and_formats_floats() -> None:
    text = markdown_table(["a", "bb"], [["x", 1.234], ["yy", 0.01234]])
    assert text.splitlines() == ["| a  | bb     |", "|----|--------|",
                                 "| x  | 1.23   |", "| yy | 0.0123 |"]


def test_bench_workload_a_prints_engine_and_transformers_rows(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_model), "--num-prompts", "4", "--min-len", "8", "--max-len", "16",
            "--output-len", "4", "--hf-batch-size", "2", "--kv-cache-gib", "0.01",
            "--gemm-size", "128"]
    assert bench_workload_a.main(argv) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert {"engine", "transformers"} <= rows.keys()
    assert float(rows["transformers"][-1]) == pytest.approx(1.0)
    assert re.search(r"greedy tokens identical to transformers: \d/4 prompts", out)


def test_bench_prefix_cache_reports_hits_only_with_caching(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_model), "--num-requests", "3", "--prefix-len", "32",
            "--min-suffix", "4", "--max-suffix", "8", "--output-len", "2",
            "--kv-cache-gib", "0.01"]
    assert bench_prefix_cache.main(argv) == 0
    rows = table_rows(capsys.readouterr().out)
    assert float(rows["on"][-1]) >= 32  # the two full prefix blocks come from the cache
    assert float(rows["off"][-1]) == 0


def test_check_memory_fails_when_the_engine_exceeds_the_budget(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_model), "--kv-cache-gib", "0.01", "--num-prompts", "2",
            "--prompt-len", "8", "--output-len", "2", "--budget-gib", "0.01"]
    assert check_memory.main(argv) == 1
    out = capsys.readouterr().out
    assert "OVER BUDGET" in out
    peak_gib = float(out.strip().splitlines()[-1].strip("|").split("|")[0])
    assert peak_gib > 0.05  # a Python process with torch loaded


@pytest.mark.slow  # ~13 s: two store processes and a default-size transfer each way
def test_bench_connector_prints_both_transfer_modes_open_and_secured(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import bench_connector

    # an exported token reaches neither configuration (the secured store knows only its own)
    monkeypatch.setenv("PDSERVE_KV_TOKEN", "exported-by-the-shell")
    argv = ["--model", str(tiny_model), "--lengths", "40", "--repeats", "2", "--threads", "1"]
    assert bench_connector.main(argv) == 0
    out = capsys.readouterr().out
    assert "per-layer streaming" in out and "whole request" in out
    header = next(line for line in out.splitlines() if line.startswith("| transfer"))
    assert "secured TTFT ms" in header and "secured/open TTFT" in header
    row = next(line for line in out.splitlines() if line.startswith("| per-layer streaming"))
    *_, xfer_cost, ttft_cost, verdict = [c.strip() for c in row.strip().strip("|").split("|")]
    assert float(xfer_cost) > 0 and float(ttft_cost) > 0 and verdict in {"ok", "MISS"}
    assert os.environ["PDSERVE_KV_TOKEN"] == "exported-by-the-shell"  # restored


def test_bench_kv_reuse_loads_the_prefix(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_kv_reuse

    argv = ["--model", str(tiny_model), "--prefix", "64", "--suffix", "8", "--repeats", "1",
            "--threads", "1", "--chunk-size", "32"]
    assert bench_kv_reuse.main(argv) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| B:"))
    assert "| 64 " in row  # the whole 64-token prefix was loaded, not computed


def test_bench_kvstore_runs_every_system(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_kvstore

    assert bench_kvstore.main(["--repeats", "1", "--latency-samples", "3", "--sizes-mb", "1"]) == 0
    out = capsys.readouterr().out
    assert "redis-py SET/GET" in out and "plain gRPC bytes" in out and "pdserve secured" in out
    rows = table_rows(out)
    # per row: 4 systems, the secured / open time ratio and its verdict, vs gRPC, vs Redis
    for measure in ("put 1 MB", "get 1 MB", "30-layer get latency p99 (ms)"):
        assert float(rows[measure][4]) > 0 and rows[measure][5] in {"ok", "MISS"}


@pytest.fixture(scope="module")
def tiny_model_json_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with the default model's tokenizer (a grammar needs real tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.unit.engine.conftest import smollm2_tokenizer_dir

    path = tmp_path_factory.mktemp("tiny-llama-json")
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    for f in smollm2_tokenizer_dir().iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    return path


@pytest.mark.slow  # ~17 s: an engine core process and the grammar backend's start-up
def test_bench_structured_compares_constrained_with_unconstrained(
    tiny_model_json_vocab: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import bench_structured

    argv = ["--model", str(tiny_model_json_vocab), "--num-requests", "2", "--max-tokens", "6",
            "--repeats", "1", "--threads", "1", "--kv-cache-gib", "0.05", "--max-model-len", "256"]
    assert bench_structured.main(argv) == 0
    out = capsys.readouterr().out
    for kind in ("greedy", "seeded"):  # the same work on both sides
        assert re.search(rf"{kind}: tokens per round: structured (\d+), unconstrained \1;", out)
    assert "load average" in out
    rows = table_rows(out)
    _, _, ratio, _, verdict = rows["output tok/s, 2 concurrent, greedy"]
    assert float(ratio) > 0 and verdict in {"ok", "MISS"}
    _, _, ratio, target, verdict = rows["output tok/s, 2 concurrent, seeded T=1"]
    assert float(ratio) > 0 and target == verdict == ""
    for measure in ("TTFT ms, new schema", "TTFT ms, cached schema", "compile ms, new schema",
                    "start to ready ms, cached schema"):
        assert float(rows[measure][0]) > 0


@pytest.mark.slow  # ~30 s: a Redis Cluster, a redis-server and four store processes
def test_bench_kvstore_cluster_prints_one_table_with_every_system(
        capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_kvstore_cluster
    from loadtest.redis_cluster import missing_tools

    if missing_tools() is not None:
        pytest.skip(str(missing_tools()))
    assert bench_kvstore_cluster.main(["--repeats", "1", "--latency-samples", "2", "--clients", "2",
                                       "--ops", "1", "--layer-tokens", "8"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert set(rows) >= {"30-layer get latency p50 (ms)", "put MB/s, 2 clients", "get MB/s, 2 clients"}
    assert all(len(cells) == 5 for cells in rows.values())


def test_bench_multihost_table_has_medians_ranges_and_ratios() -> None:
    from benchmarks.bench_multihost import table

    rows = table_rows(table({"namespaces": [[10.0, 20.0, 5.0], [12.0, 30.0, 6.0], [14.0, 40.0, 7.0]],
                             "loopback": [[10.0, 20.0, 5.0]] * 3},
                            {"namespaces": (0, 8), "loopback": (8, 8)}))
    assert rows["TTFT p50 (ms)"] == ["12.0 (10-14)", "10.0 (10-10)", "1.20x"]
    assert rows["ITL p99 (ms)"][2] == "1.20x"
    assert rows["KV objects put via shared memory"][:2] == ["0 of 8", "8 of 8"]


def test_bench_tp_compares_tp_sizes_and_every_handoff_pair(tiny_model: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_tp

    argv = ["--model", str(tiny_model), "--num-prompts", "4", "--min-len", "8", "--max-len", "24",
            "--output-len", "4", "--handoff-prompts", "2", "--handoff-len", "40"]
    assert bench_tp.main(argv) == 0
    rows = table_rows(capsys.readouterr().out)
    assert rows["TP 1"][3] == rows["TP 2"][3] == "4/4"  # the same greedy tokens
    assert float(rows["TP 2"][4]) > 0 and float(rows["TP 1"][4]) == 0  # comm share: TP 2 only
    for pair in ("P1 -> D1", "P1 -> D2", "P2 -> D1", "P2 -> D2"):
        assert rows[pair][3:] == ["2/2", "yes"], pair


@pytest.mark.slow  # ~40 s: two engine core processes
def test_bench_spec_compares_plain_and_speculative_decoding_in_one_table(
        tiny_model_json_vocab: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_spec

    argv = ["--model", str(tiny_model_json_vocab), "--batches", "1,2", "--output-len", "12",
            "--requests", "2", "--min-len", "8", "--max-len", "24", "--dtype", "float32"]
    assert bench_spec.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("| rewrite") or line.startswith("| random")]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (w, b, p) for w in ("rewrite", "random") for b in ("1", "2") for p in ("none", "ngram k=4")]
    for r in rows:
        assert float(r[3]) > 0 and r[7] == "2/2"  # speculation never changes greedy tokens
        assert (r[8] == "-") == (r[2] == "none")


@pytest.mark.slow  # ~60 s: two workers and two routers as processes
def test_bench_prefix_routing_compares_both_indexes_in_one_table(
        tiny_model_json_vocab: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_prefix_routing

    argv = ["--model", str(tiny_model_json_vocab), "--workers", "2", "--routers", "1",
            "--conversations", "2", "--turns", "2", "--system-words", "20", "--user-words", "8",
            "--output-len", "4", "--num-kv-blocks", "64", "--max-model-len", "256", "--repeats", "1"]
    assert bench_prefix_routing.main(argv) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith(("| events", "| approximate"))]
    assert [r[0] for r in rows] == ["events", "approximate"]
    for r in rows:
        assert r[1] == "4" and 0.0 <= float(r[2]) <= 1.0  # 2 conversations x 2 turns each
    assert rows[0][8] == "-" and rows[1][7] == "-"  # each router chose on its own index only
