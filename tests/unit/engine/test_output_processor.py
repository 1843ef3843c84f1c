"""OutputProcessor: core token outputs -> RequestOutputs (text checked against HF decode)."""

from __future__ import annotations

import asyncio
import math

import pytest

from engine.core.outputs import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsEntry,
    RequestTimes,
)
from engine.output_processor import OutputProcessor, RequestOutputCollector, find_stop_string
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

TEXT = "Hello world. Goodbye 🎉 world, 你好!"




def add(op: OutputProcessor, request_id: str, params: SamplingParams,
        collector: RequestOutputCollector | None = None) -> list[str]:
    if params.n == 1:
        reqs = [EngineCoreRequest(request_id, [1, 2, 3], params)]
    else:
        reqs = [EngineCoreRequest(f"{i}_{request_id}", [1, 2, 3], params.for_child(i))
                for i in range(params.n)]
    op.add_request(request_id, "prompt", reqs, params, collector)
    return [r.request_id for r in reqs]


def feed(op: OutputProcessor, core_id: str, ids: list[int],
         final: FinishReason | None = FinishReason.LENGTH) -> tuple[list[RequestOutput], list[str]]:
    """One core output per token; the last carries `final`. Returns outputs and aborts."""
    outs, aborts = [], []
    for i, tid in enumerate(ids):
        done = final if i == len(ids) - 1 else None
        times = RequestTimes(arrival_time=1.0, first_token_time=1.5, finished_time=2.0,
                             num_cached_tokens=16) if done is not None else None
        result = op.process_outputs([EngineCoreOutput(core_id, [tid], finish_reason=done,
                                                      times=times)])
        outs += result.request_outputs
        aborts += result.reqs_to_abort
        if result.reqs_to_abort:
            break
    return outs, aborts


def test_cumulative_outputs_grow_to_the_full_decode(tokenizer):
    ids = tokenizer(TEXT).input_ids
    op = OutputProcessor(tokenizer)
    add(op, "r", SamplingParams(max_tokens=len(ids)))
    outs, aborts = feed(op, "r", ids)
    assert aborts == [] and len(outs) == len(ids)
    texts = [o.outputs[0].text for o in outs]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    final = outs[-1]
    assert final.finished and not outs[-2].finished
    assert final.outputs[0].text == tokenizer.decode(ids)
    assert final.outputs[0].token_ids == ids
    assert final.outputs[0].finish_reason == "length"
    assert final.metrics is not None and final.metrics.ttft == pytest.approx(0.5)
    assert final.num_cached_tokens == 16
    assert not op.has_unfinished_requests()


def test_delta_outputs_concatenate_to_the_full_decode(tokenizer):
    ids = tokenizer(TEXT).input_ids
    op = OutputProcessor(tokenizer)
    add(op, "r", SamplingParams(output_kind=RequestOutputKind.DELTA))
    outs, _ = feed(op, "r", ids)
    assert "".join(o.outputs[0].text for o in outs) == tokenizer.decode(ids)
    assert [t for o in outs for t in o.outputs[0].token_ids] == ids


def test_final_only_gives_one_output(tokenizer):
    ids = tokenizer(TEXT).input_ids
    op = OutputProcessor(tokenizer)
    add(op, "r", SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
    outs, _ = feed(op, "r", ids)
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].text == tokenizer.decode(ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text_and_asks_for_an_abort(tokenizer, include):
    ids = tokenizer(TEXT).input_ids
    op = OutputProcessor(tokenizer)
    add(op, "r", SamplingParams(stop=["Goodbye", "你好"], include_stop_str_in_output=include))
    outs, aborts = feed(op, "r", ids)
    assert aborts == ["r"]
    final = outs[-1].outputs[0]
    assert final.text == ("Hello world. Goodbye" if include else "Hello world. ")
    assert (final.finish_reason, final.stop_reason) == ("stop", "Goodbye")
    assert outs[-1].finished and not op.has_unfinished_requests()
    # Later core outputs for the request (before the abort lands) are ignored.
    assert op.process_outputs([EngineCoreOutput("r", [5])]).request_outputs == []


def test_streamed_deltas_never_show_part_of_a_stop_string(tokenizer):
    ids = tokenizer("one two three four five").input_ids
    op = OutputProcessor(tokenizer)
    add(op, "r", SamplingParams(stop=["three four"], output_kind=RequestOutputKind.DELTA))
    outs, aborts = feed(op, "r", ids)
    assert aborts == ["r"]
    deltas = [o.outputs[0].text for o in outs]
    assert "".join(deltas) == "one two "
    assert all("thr" not in d for d in deltas)


def test_stop_string_found_when_the_core_finished_too(tokenizer):
    ids = tokenizer("abc STOP").input_ids
    assert "STOP" not in tokenizer.decode(ids[:-1])
    op = OutputProcessor(tokenizer)
    add(op, "r", SamplingParams(stop=["STOP"]))
    op.process_outputs([EngineCoreOutput("r", ids[:-1])])
    result = op.process_outputs([EngineCoreOutput("r", ids[-1:], finish_reason=FinishReason.LENGTH)])
    assert result.reqs_to_abort == []  # the core is done with it already
    out = result.request_outputs[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("abc ", "stop", "STOP")


def test_stop_token_reason_comes_from_the_core(tokenizer):
    op = OutputProcessor(tokenizer)
    add(op, "r", SamplingParams())
    result = op.process_outputs(
        [EngineCoreOutput("r", [2], finish_reason=FinishReason.STOP, stop_reason=2)])
    out = result.request_outputs[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", 2)  # EOS skipped


def test_n_samples_are_aggregated_and_finish_together(tokenizer):
    a, b = tokenizer("first answer").input_ids, tokenizer("second one").input_ids
    op = OutputProcessor(tokenizer)
    ids = add(op, "r", SamplingParams(n=2))
    assert ids == ["0_r", "1_r"]
    r1 = op.process_outputs([EngineCoreOutput("0_r", a, finish_reason=FinishReason.LENGTH),
                             EngineCoreOutput("1_r", b[:1])]).request_outputs
    assert len(r1) == 1 and not r1[0].finished
    assert [o.index for o in r1[0].outputs] == [0, 1]
    r2 = op.process_outputs([EngineCoreOutput("1_r", b[1:], finish_reason=FinishReason.STOP)])
    final = r2.request_outputs[0]
    assert final.finished
    assert [o.text for o in final.outputs] == ["first answer", "second one"]
    assert [o.finish_reason for o in final.outputs] == ["length", "stop"]


def test_logprobs_are_decoded_with_ranks(tokenizer):
    hello, world = tokenizer("Hello world").input_ids
    op = OutputProcessor(tokenizer)
    add(op, "r", SamplingParams(logprobs=2))
    entry = LogprobsEntry(token_ids=[world, hello, world], logprobs=[-0.5, -0.1, -0.5],
                          sampled_rank=2)
    result = op.process_outputs([EngineCoreOutput("r", [world], new_logprobs=[entry])])
    out = result.request_outputs[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 1
    position = out.logprobs[0]
    assert set(position) == {hello, world}
    assert (position[world].rank, position[world].decoded_token) == (2, " world")
    assert (position[hello].rank, position[hello].decoded_token) == (1, "Hello")
    assert math.isclose(out.cumulative_logprob or 0.0, -0.5)


def test_abort_returns_child_ids_and_ends_the_stream(tokenizer):
    async def scenario() -> RequestOutput:
        op = OutputProcessor(tokenizer)
        collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
        add(op, "r", SamplingParams(n=2), collector)
        op.process_outputs([EngineCoreOutput("0_r", [5], finish_reason=FinishReason.LENGTH)])
        assert op.abort_requests(["r", "unknown"]) == ["1_r"]
        assert not op.has_unfinished_requests()
        return await collector.get()

    final = asyncio.run(scenario())
    assert final.finished
    assert [o.finish_reason for o in final.outputs] == ["length", "abort"]


def test_collector_merges_deltas_and_keeps_the_latest_cumulative():
    def output(text: str, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, [len(text)])], finished)

    delta = RequestOutputCollector(RequestOutputKind.DELTA)
    delta.put(output("ab"))
    delta.put(output("cd", finished=True))
    merged = delta.get_nowait()
    assert merged is not None and merged.finished
    assert (merged.outputs[0].text, merged.outputs[0].token_ids) == ("abcd", [2, 2])
    cumulative = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    cumulative.put(output("a"))
    cumulative.put(output("ab"))
    latest = cumulative.get_nowait()
    assert latest is not None and latest.outputs[0].text == "ab"
    assert cumulative.get_nowait() is None
    cumulative.put(RuntimeError("dead"))
    cumulative.put(output("abc"))
    with pytest.raises(RuntimeError, match="dead"):
        cumulative.get_nowait()


def test_find_stop_string_picks_the_earliest_match_in_new_text():
    assert find_stop_string("xx ab cd", 0, ["cd", "ab"], False) == ("ab", 3)
    assert find_stop_string("xx ab cd", 0, ["cd", "ab"], True) == ("ab", 5)
    assert find_stop_string("xx ab cd", 7, ["ab"], False) is None  # already checked
    assert find_stop_string("xx ab cd", 4, ["ab"], False) == ("ab", 3)  # ends in new text


def test_stop_string_matches_text_held_back_for_partial_characters(tokenizer):
    lone_byte = next(t for t in range(100, 300) if tokenizer.decode([t] * 3) == "\ufffd" * 3)
    op = OutputProcessor(tokenizer)
    add(op, "r", SamplingParams(stop=["\ufffd\ufffd"], include_stop_str_in_output=True))
    outs, aborts = feed(op, "r", [lone_byte] * 10)
    assert aborts == ["r"] and len(outs[-1].outputs[0].token_ids) == 2
    assert outs[-1].outputs[0].text == tokenizer.decode([lone_byte] * 2)
