"""The "sjf" scheduling policy: fewest tokens left first, chunked prefills yield to shorter
waiting prompts, a step holding a prefill takes others only if they complete in it, decodes
are never held back, and a request waiting too long goes first."""

from __future__ import annotations

import random
import time

import pytest

from engine.config import EngineConfig
from engine.core.request_queue import ShortestFirstQueue
from tests.unit.engine.core.test_scheduler import make_scheduler, req, run_step


def test_waiting_requests_go_shortest_first() -> None:
    s = make_scheduler(scheduling_policy="sjf", max_num_batched_tokens=8)
    now = time.time()
    s.add_request(req("long", 20, arrival=now))
    s.add_request(req("short", 5, arrival=now + 1))
    s.add_request(req("tiny", 2, arrival=now + 2))
    out, _ = run_step(s)
    # Both short prompts complete in the step; a chunk of the long one would only delay them.
    assert out.num_scheduled_tokens == {"tiny": 2, "short": 5}
    out, _ = run_step(s)
    assert out.num_scheduled_tokens["long"] == 6  # beside the two decodes


def test_a_chunked_prefill_yields_to_a_shorter_prompt_and_takes_the_rest() -> None:
    s = make_scheduler(scheduling_policy="sjf", max_num_batched_tokens=8)
    s.add_request(req("long", 40, arrival=time.time()))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"long": 8}
    s.add_request(req("short", 6, arrival=time.time()))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"short": 6}
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}
    # Same step order under fcfs: the prefill under way keeps the budget.
    f = make_scheduler(max_num_batched_tokens=8)
    f.add_request(req("long", 40))
    run_step(f)
    f.add_request(req("short", 6))
    out, _ = run_step(f)
    assert out.num_scheduled_tokens == {"long": 8}


def test_a_prefill_with_fewer_tokens_left_than_the_waiting_head_keeps_going() -> None:
    s = make_scheduler(scheduling_policy="sjf", max_num_batched_tokens=8)
    s.add_request(req("a", 12, arrival=time.time()))
    run_step(s)  # a has 4 tokens left
    s.add_request(req("b", 10, arrival=time.time()))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 4}
    s.add_request(req("c", 3, arrival=time.time()))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "c": 3}  # b's chunk would not complete


def test_decodes_are_never_deferred() -> None:
    s = make_scheduler(scheduling_policy="sjf", max_num_batched_tokens=8)
    s.add_request(req("d", 3, max_tokens=10, arrival=time.time()))
    run_step(s)  # d decodes from now on: one token left per step
    s.add_request(req("w", 20, arrival=time.time()))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"d": 1, "w": 7}


def test_a_request_waiting_past_max_wait_goes_ahead_of_shorter_ones() -> None:
    s = make_scheduler(scheduling_policy="sjf", sjf_max_wait_s=5.0, max_num_batched_tokens=8)
    now = time.time()
    s.add_request(req("old-long", 20, arrival=now - 6))
    s.add_request(req("new-short", 4, arrival=now))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["old-long"]
    # An aged prefill under way is not deferred either.
    s.add_request(req("newer-short", 3, arrival=time.time()))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens["old-long"] == 8


def test_queue_order_and_preempted_requests_first() -> None:
    clock = [100.0]
    q = ShortestFirstQueue(max_wait_s=10.0, clock=lambda: clock[0])
    a, b, c = req("a", 30, arrival=99.0), req("b", 5, arrival=99.5), req("c", 5, arrival=99.8)
    for r in (a, b, c):
        q.add(r)
    assert [r.request_id for r in q] == ["b", "c", "a"]  # equal lengths: older first
    p = req("p", 50, arrival=100.0)
    q.prepend(p)
    assert q.pop() is p
    clock[0] = 109.0  # a has waited 10 s (b 9.5, c 9.2): first
    assert q.peek() is a and len(q) == 3
    q.remove(b)
    assert [q.pop(), q.pop()] == [a, c] and len(q) == 0


def test_random_load_with_preemption_ends_every_request_and_frees_every_block() -> None:
    rng = random.Random(3)
    s = make_scheduler(num_blocks=20, scheduling_policy="sjf", max_num_batched_tokens=16,
                       enable_prefix_caching=False)
    free_at_start = s.kv.num_free_blocks
    added, finished, preempted = 0, set(), 0
    for _ in range(2000):
        if added < 40 and rng.random() < 0.3:
            s.add_request(req(f"r{added}", rng.randrange(1, 40), max_tokens=rng.randrange(1, 12),
                              arrival=time.time()))
            added += 1
        if not s.has_unfinished_requests():
            if added == 40:
                break
            continue
        out, res = run_step(s)
        preempted += len(out.preempted_req_ids)
        finished |= {o.request_id for o in res if o.finished}
        assert sum(out.num_scheduled_tokens.values()) <= 16
    assert added == 40 and len(finished) == 40, f"{len(finished)} of {added} requests ended"
    assert preempted > 0, "the load forced no preemption"
    assert s.kv.num_free_blocks == free_at_start


def test_sjf_max_wait_must_be_positive() -> None:
    with pytest.raises(ValueError, match="sjf_max_wait_s"):
        EngineConfig(model="x", scheduling_policy="sjf", sjf_max_wait_s=0)


def test_a_request_ageing_between_peek_and_pop_is_not_lost() -> None:
    """The scheduler allocates for the request it peeked; pop() must remove that one even if
    another crossed sjf_max_wait_s in between (it would otherwise be dropped from the queue)."""
    s = make_scheduler(scheduling_policy="sjf", max_num_batched_tokens=4, sjf_max_wait_s=10.0)
    base = time.time()
    old, short = req("old", 20, arrival=base - 9.95), req("short", 3, arrival=base)
    s.add_request(old)
    s.add_request(short)
    ticks = iter([0.0, 0.0] + [1.0] * 100)  # old ages between the step's last peek and its pop
    s.waiting._clock = lambda: base + next(ticks)  # type: ignore[attr-defined]
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"short": 3}
    assert list(s.waiting) == [old] and s.running == [short]
    out, _ = run_step(s)
    assert out.num_scheduled_tokens["old"] == 3  # aged: next, beside short's decode


def test_two_partial_prefills_never_share_a_step() -> None:
    s = make_scheduler(scheduling_policy="sjf", max_num_batched_tokens=8)
    s.add_request(req("long", 40, arrival=time.time()))
    run_step(s)  # long: 32 left
    s.add_request(req("w", 10, arrival=time.time()))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"w": 8}
    out, _ = run_step(s)  # nothing waits now: long's chunk would still only delay w
    assert out.num_scheduled_tokens == {"w": 2}
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"w": 1, "long": 7}


def test_a_deferred_prefill_never_preempts_what_the_step_scheduled() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, scheduling_policy="sjf", max_num_batched_tokens=12,
                       sjf_max_wait_s=5.0, enable_prefix_caching=False, long_prefill_token_threshold=6)
    now = time.time()
    s.add_request(req("e", 1, max_tokens=2, arrival=now))
    s.add_request(req("d", 12, arrival=now))
    run_step(s)  # e decodes, d has 6 of 12
    s.add_request(req("aged", 40, arrival=now - 100))
    run_step(s)
    s.add_request(req("w", 2, arrival=now))  # d is deferred for w; w finds no free block
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"aged": 6} and not out.preempted_req_ids
