"""`pdserve generate` on a tiny model folder; the text is checked against transformers' greedy
continuation decoded by the tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def tiny_args(model: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--max-model-len", "128", "--num-kv-blocks", "32",
            "--num-threads", "2", "--temperature", "0", "--ignore-eos", *extra]


def expected_text(model: Path, prompt: str, max_new: int, hf_greedy) -> tuple[list[int], str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    ids = hf_greedy(model, [tok(prompt).input_ids], max_new)[0]
    return ids, str(tok.decode(ids, skip_special_tokens=True))


def test_generate_prints_the_greedy_text(tiny_model_dir, hf_greedy, capsys) -> None:
    from services.cli import main

    model = tiny_model_dir("llama")
    assert main(tiny_args(model, "--prompt", "Hello world", "--max-tokens", "6")) == 0
    _, text = expected_text(model, "Hello world", 6, hf_greedy)
    assert capsys.readouterr().out == text + "\n"


def test_generate_json_lists_every_prompt_and_sample(tiny_model_dir, hf_greedy, capsys) -> None:
    from services.cli import main

    model = tiny_model_dir("llama")
    args = tiny_args(model, "--prompt", "One", "--prompt", "Two three", "--max-tokens", "4",
                     "--n", "2", "--json")
    assert main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt_index"], r["index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r, prompt in zip(rows, ["One", "One", "Two three", "Two three"], strict=True):
        ids, text = expected_text(model, prompt, 4, hf_greedy)
        assert (r["token_ids"], r["text"], r["finish_reason"]) == (ids, text, "length")


def test_bad_arguments_exit_with_a_message(tiny_model_dir, capsys) -> None:
    from services.cli import main

    assert main(tiny_args(tiny_model_dir("llama"), "--prompt", "x", "--top-p", "0")) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["no-such-command"])


def test_module_entry_point_runs_chat(tiny_model_dir) -> None:
    model = tiny_model_dir("llama")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    result = subprocess.run(
        [sys.executable, "-m", "services.cli",
         *tiny_args(model, "--chat", "--prompt", "Hi", "--max-tokens", "3", "--json")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(row["token_ids"]) == 3 and row["finish_reason"] == "length"


@pytest.mark.parametrize(("argv", "policy", "budget"), [
    (["--role", "prefill"], "sjf", 512),
    (["--role", "prefill", "--device", "cuda"], "sjf", 2048),
    (["--role", "prefill", "--scheduling-policy", "fcfs", "--max-num-batched-tokens", "4096"],
     "fcfs", 4096),
    (["--role", "decode"], "fcfs", 2048),
    (["--role", "colocated", "--scheduling-policy", "sjf", "--sjf-max-wait-s", "3"], "sjf", 2048),
])
def test_worker_scheduling_defaults_depend_on_the_role(argv: list[str], policy: str,
                                                       budget: int) -> None:
    from services.cli import build_parser, worker_engine_config

    cfg = worker_engine_config(build_parser().parse_args(["worker", *argv]))
    assert (cfg.scheduling_policy, cfg.max_num_batched_tokens) == (policy, budget)
    if "--sjf-max-wait-s" in argv:
        assert cfg.sjf_max_wait_s == 3.0


def test_bad_scheduling_values_name_the_field() -> None:
    from services.cli import build_parser, worker_engine_config

    for argv, field in ((["--max-num-batched-tokens", "0"], "max_num_batched_tokens"),
                        (["--sjf-max-wait-s", "-1"], "sjf_max_wait_s")):
        with pytest.raises(ValueError, match=field):
            worker_engine_config(build_parser().parse_args(["worker", "--role", "prefill", *argv]))


def test_ctrl_c_while_a_worker_starts_stops_it_without_tracebacks(tiny_model_dir, tmp_path) -> None:
    """A terminal's Ctrl-C reaches the worker and its engine core (one process group) while the
    core is still importing: the core ignores it from its first instruction (inherited), the
    worker stops once started, with its closing line."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from services.procs import free_port

    argv = [sys.executable, "-m", "services.cli", "worker", "--role", "colocated", "--model",
            str(tiny_model_dir("llama")), "--port", str(free_port()), "--num-threads", "1",
            "--kv-cache-gib", "0.05", "--max-model-len", "256"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)  # until the engine core exists (it then imports torch for seconds)
        time.sleep(1.0)  # past the interpreter's own start-up, inside the core's imports
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 0, err
    assert "pdserve colocated worker stopped" in out, out
