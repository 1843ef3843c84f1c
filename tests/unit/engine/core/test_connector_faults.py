"""A connector call that fails on one request's data ends that request (an abort output naming the
cause, its blocks freed) and nothing else; kv_transfer_params of the wrong types or sizes are
refused before they reach a scheduler."""

from __future__ import annotations

from typing import Any

import pytest

from engine.connector.base import KVConnectorScheduler
from engine.connector.transfer_params import check_transfer_params
from engine.core.outputs import FinishReason
from engine.core.request import Request
from tests.unit.engine.core.test_scheduler import make_scheduler, req, run_step

KEY = "m@1@0@7b@float"


class FragileConnector(KVConnectorScheduler):
    """Raises on requests whose id says so, in the call the id names."""

    def __init__(self) -> None:
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if "match" in request.request_id:
            raise TypeError("'int' object is not iterable")
        return (8, True) if "alloc" in request.request_id else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[list[int]],
                                 num_external_tokens: int) -> None:
        if "alloc" in request.request_id:
            raise KeyError("keys")

    def build_connector_meta(self, scheduler_output: Any) -> None:
        return None

    def request_finished(self, request: Request, block_ids: list[list[int]]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append(request.request_id)
        if "finish" in request.request_id:
            raise ValueError("lease failed")
        return False, None


@pytest.mark.parametrize("bad", ["bad-match", "bad-alloc"])
def test_a_connector_error_on_one_request_fails_that_request_only(bad: str) -> None:
    s = make_scheduler(max_num_batched_tokens=64)
    s.connector = FragileConnector()
    free = s.kv.num_free_blocks
    s.add_request(req("good-1", 12, max_tokens=2))
    s.add_request(req(bad, 12, max_tokens=2))
    s.add_request(req("good-2", 12, max_tokens=2))
    outputs = []
    for _ in range(10):
        if not s.has_unfinished_requests():
            break
        outputs += run_step(s)[1]
    failed = [o for o in outputs if o.request_id == bad]
    assert len(failed) == 1 and failed[0].finish_reason == FinishReason.ABORT
    assert failed[0].new_token_ids == [] and "kv connector" in str(failed[0].stop_reason)
    done = {o.request_id for o in outputs if o.finish_reason == FinishReason.LENGTH}
    assert done == {"good-1", "good-2"}
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == free


def test_request_finished_failing_still_ends_the_request_and_frees_it() -> None:
    s = make_scheduler()
    s.connector = FragileConnector()
    free = s.kv.num_free_blocks
    s.add_request(req("finish", 8, max_tokens=1))
    _, outputs = run_step(s)
    assert outputs[0].finish_reason == FinishReason.LENGTH and outputs[0].kv_transfer_params is None
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == free


@pytest.mark.parametrize(("params", "field"), [
    ({"do_remote_prefill": True, "keys": 5, "num_tokens": 30}, "num_tokens"),  # the shape
    ({"do_remote_prefill": True, "keys": 5, "num_tokens": 3}, "keys"),
    ({"do_remote_prefill": True, "keys": [KEY] * 3, "num_tokens": 3}, "keys: 3 keys"),
    ({"do_remote_prefill": True, "keys": ["x"], "num_tokens": 3}, "keys[0]"),
    ({"do_remote_prefill": True, "keys": [7], "num_tokens": 3}, "keys[0]"),
    ({"do_remote_prefill": True, "keys": [KEY], "num_tokens": True}, "num_tokens"),
    ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    ({"do_remote_decode": True, "transfer_id": "t" * 600}, "transfer_id"),
    ([1, 2], "must be a dict"),
    # a key's world size says which ranks' objects a load reads: 0 would read none and call the
    # prompt loaded, a huge one would make its release list every rank
    ({"do_remote_prefill": True, "keys": ["m@0@0@7b@float"], "num_tokens": 3}, "keys[0]"),
    ({"do_remote_prefill": True, "keys": ["m@1000000000@0@7b@float"], "num_tokens": 3},
     "keys[0]: world_size"),
    ({"do_remote_prefill": True, "keys": [KEY], "num_tokens": 3, "tp_size": 2}, "keys[0]: world_size"),
    ({"do_remote_prefill": True, "keys": ["m@2@1@7b@float"], "num_tokens": 3}, "worker_id 0"),
    ({"do_remote_decode": True, "tp_size": 0}, "tp_size"),
])
def test_malformed_transfer_params_are_refused_naming_the_field(params: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        check_transfer_params(params, num_prompt_tokens=20, chunk_size=16)


def test_well_formed_transfer_params_pass() -> None:
    check_transfer_params(None, 20, 16)
    check_transfer_params({"do_remote_decode": True, "transfer_id": "t1"}, 20, 16)
    check_transfer_params({"do_remote_prefill": True, "keys": [KEY, KEY], "num_tokens": 20,
                           "transfer_id": "t1", "kv_store_url": "grpc://h:1"}, 20, 16)
    check_transfer_params({"do_remote_prefill": True, "keys": ["m@2@0@7b@float"], "num_tokens": 3,
                           "tp_size": 2}, 20, 16)
