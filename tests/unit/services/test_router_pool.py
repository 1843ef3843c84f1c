"""The router's worker choice without a network: prefix index matching, the least-loaded and
prefix-aware policies over fabricated load reports, saturation, health marking."""

from __future__ import annotations

import asyncio

import pytest

from protos import worker_pb2 as pb
from services.router.dispatch.pool import PoolOptions, WorkerPool, WorkerState, is_down
from services.router.dispatch.prefix_index import PrefixIndex, block_hashes
from services.worker.client import WorkerError


def test_block_hashes_chain_over_full_blocks_only() -> None:
    a = block_hashes(list(range(40)), 16)
    b = block_hashes([*range(32), 99, 98], 16)
    assert len(a) == 2 and a == b  # the partial third block is not hashed
    c = block_hashes([1000, *range(1, 40)], 16)
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every later hash


def test_prefix_index_matches_leading_blocks_and_forgets_the_oldest() -> None:
    idx = PrefixIndex(block_size=4, max_blocks=3)
    assert idx.insert(block_hashes(list(range(8)), 4)) == 0  # 2 blocks, none there before
    assert idx.match(block_hashes(list(range(12)), 4)) == 8
    assert idx.match(block_hashes([5, *range(1, 12)], 4)) == 0
    assert idx.insert(block_hashes([*range(4), 9, 9, 9, 9], 4)) == 4  # its first block was there
    idx.insert(block_hashes([7, 7, 7, 7, 8, 8, 8, 8], 4))  # 2 more: the oldest blocks go
    assert len(idx) == 3
    assert idx.match(block_hashes(list(range(8)), 4)) == 0  # its blocks were evicted (the oldest)
    idx.clear()
    assert len(idx) == 0


def report(waiting: int, running: int, used_blocks: int = 0, instance: str = "i") -> pb.LoadReport:
    return pb.LoadReport(num_waiting=waiting, num_running=running, num_total_blocks=1000,
                         num_free_blocks=1000 - used_blocks, serving=True, instance_id=instance)


async def make_pool(policy: str, loads: list[tuple[int, int]]) -> WorkerPool:
    pool = WorkerPool("decode", [f"127.0.0.1:{1 + i}" for i in range(len(loads))],
                      PoolOptions(policy=policy))  # type: ignore[arg-type]
    for w, (waiting, running) in zip(pool.workers, loads, strict=True):
        w.load = report(waiting, running)
    return pool


async def test_least_loaded_uses_vllms_score_and_counts_requests_sent_since_the_report() -> None:
    pool = await make_pool("least_loaded", [(1, 0), (0, 3), (0, 5)])  # scores 4, 3, 5
    try:
        first = pool.pick()
        assert first is not None and first.worker.target == "127.0.0.1:2"
        pool.acquire(first.worker)
        pool.acquire(first.worker)  # 3 + 2 sent since the report = 5 > 4
        second = pool.pick()
        assert second is not None and second.worker.target == "127.0.0.1:1"
        w1 = pool.workers[0]
        w1.load, w1.sent_since_report = report(0, 0), 0  # a fresh report resets the estimate
        third = pool.pick()
        assert third is not None and third.worker is w1
    finally:
        await pool.close()


async def test_prefix_aware_weighs_the_cached_prefix_against_the_work_a_worker_holds() -> None:
    pool = await make_pool("prefix_aware", [(0, 0), (0, 0)])
    hashes = block_hashes(list(range(64)), 16)  # 64 prompt tokens, all cached on worker 2
    w1, w2 = pool.workers
    try:
        w2.prefix.insert(hashes)
        pick = pool.pick(hashes, prompt_tokens=64)
        # 48: the engine computes a prompt's last token, so a whole-block prompt hits a block less
        assert pick is not None and (pick.worker, pick.matched_tokens) == (w2, 48)
        # Worker 2 holds 32 tokens of KV (cost 16 + 32) < worker 1 computing 64: still worker 2.
        w2.load = report(0, 1, used_blocks=2)
        assert (p := pool.pick(hashes, prompt_tokens=64)) is not None and p.worker is w2
        # 80 tokens held: more than the prefix saves; the idle worker gets the request.
        w2.load = report(0, 1, used_blocks=5)
        p = pool.pick(hashes, prompt_tokens=64)
        assert p is not None and (p.worker, p.matched_tokens) == (w1, 0)
        # Requests sent since the last report count a prompt's worth each.
        w2.load = report(0, 0)
        pool.acquire(w2, hashes)
        pool.acquire(w2, hashes)
        assert (p := pool.pick(hashes, prompt_tokens=64)) is not None and p.worker is w1
        other = pool.pick(block_hashes(list(range(100, 164)), 16), prompt_tokens=64)
        assert other is not None and other.matched_tokens == 0
    finally:
        await pool.close()


async def test_a_request_that_ended_after_the_report_does_not_send_its_prefix_elsewhere() -> None:
    """A load report taken while a request ran still shows its blocks after it ended: until the
    next report, those blocks are taken off, so the next request sharing its prefix goes where
    the prefix is cached (a flaky router test in CI, where a report fell in the first request)."""
    pool = await make_pool("prefix_aware", [(0, 0), (0, 0)])
    cached, idle = pool.workers
    prompt = list(range(62))  # 3 full blocks (48 tokens) are the shared prefix
    hashes = block_hashes(prompt, 16)
    reports = {cached.target: report(0, 1, used_blocks=5), idle.target: report(0, 0)}
    for w in pool.workers:
        w.client.load = (lambda t: lambda: _answer(reports[t]))(w.target)  # type: ignore[method-assign]
    try:
        lease = pool.acquire(cached, hashes)
        await pool.refresh()  # taken while the request runs: 5 blocks in use
        assert cached.held_tokens(16, 62) == 80
        pick = pool.pick(hashes, prompt_tokens=62)  # 80 held > 48 saved: the idle worker
        assert pick is not None and pick.worker is idle
        pool.release(lease, tokens=62 + 2)  # ended with 2 output tokens: 4 blocks
        assert cached.held_tokens(16, 62) == 16
        pick = pool.pick(hashes, prompt_tokens=62)
        assert pick is not None and (pick.worker, pick.matched_tokens) == (cached, 48)
        # A request sent after the report was not in it: its end takes nothing off.
        pool.release(pool.acquire(cached, hashes), tokens=64)
        assert cached.held_tokens(16, 62) == 16
        reports[cached.target] = report(0, 0)
        await pool.refresh()  # the next report is the truth again
        assert (cached.freed_since_report, cached.held_tokens(16, 62)) == (0, 0)
        # A queued request the report counted: taken off when it ends, never below zero.
        reports[cached.target] = report(1, 0)
        lease = pool.acquire(cached, hashes)
        await pool.refresh()
        assert cached.held_tokens(16, 62) == 62
        pool.release(lease, tokens=200)
        assert cached.held_tokens(16, 62) == 0
    finally:
        await pool.close()


async def test_ended_requests_take_off_their_own_blocks_only() -> None:
    """Blocks of a prefix the request found cached may be used by others still running: its end
    takes off its own blocks only. A request that never ran there (a failed prefill: 0 tokens)
    takes off nothing."""
    pool = await make_pool("prefix_aware", [(0, 0)])
    w = pool.workers[0]
    system = list(range(48))
    first, second = [*system, *range(100, 114)], [*system, *range(200, 214)]  # 62 tokens each
    reports = [report(0, 2, used_blocks=3 + 1 + 1)]  # the shared 3 blocks + 1 own block each
    w.client.load = lambda: _answer(reports[-1])  # type: ignore[method-assign]
    try:
        a = pool.acquire(w, block_hashes(first, 16))
        b = pool.acquire(w, block_hashes(second, 16))
        assert (a.matched_tokens, b.matched_tokens) == (0, 48)
        failed = pool.acquire(w, block_hashes(second, 16))
        await pool.refresh()
        assert w.held_tokens(16, 62) == 80
        pool.release(failed, tokens=0)
        assert w.held_tokens(16, 62) == 80
        pool.release(b, tokens=62)  # its own block only: the system prompt is still in use
        assert w.held_tokens(16, 62) == 64
        pool.release(a, tokens=62)  # 4 blocks, all its own
        assert w.held_tokens(16, 62) == 0
    finally:
        await pool.close()


async def test_requests_sent_or_ended_while_a_report_is_in_flight() -> None:
    """The worker computes a report at some moment between the ask and the answer, so it may
    count every request dispatched before it arrives (the rule that keeps an idle worker from
    looking busy: asked before the first request was sent, a report computed while it ran made
    the flaky CI test fail again under load). A request that ended while the report was in
    flight comes off once it arrives; one sent while it flew comes off when it ends."""
    pool = await make_pool("prefix_aware", [(0, 0)])
    w = pool.workers[0]
    answer: asyncio.Future[pb.LoadReport] = asyncio.get_running_loop().create_future()

    async def load() -> pb.LoadReport:
        return await answer

    w.client.load = load  # type: ignore[method-assign]
    try:
        asking = asyncio.create_task(pool.refresh())
        while not w.asking:  # the report is asked for
            await asyncio.sleep(0)
        first = pool.acquire(w, block_hashes(list(range(64)), 16))  # sent after the ask...
        late = pool.acquire(w, block_hashes(list(range(500, 564)), 16))
        pool.release(first, tokens=64)  # ...and ended while it flies
        answer.set_result(report(0, 2, used_blocks=8))  # computed while both ran
        await asking
        assert (w.counted_upto, w.sent_since_report, w.freed_since_report) == (2, 0, 64)
        assert w.held_tokens(16, 64) == 128 - 64  # the first one's 4 blocks off
        pool.release(late, tokens=64)  # dispatched before the report arrived: off too
        assert w.held_tokens(16, 64) == 0
        sent_after = pool.acquire(w, block_hashes(list(range(900, 964)), 16))
        assert w.held_tokens(16, 64) == 64  # a prompt's worth until a report counts it
        pool.release(sent_after, tokens=64)  # not in any report: nothing taken off
        assert (w.freed_since_report, w.held_tokens(16, 64)) == (128, 0)
    finally:
        await pool.close()


async def _answer(load: pb.LoadReport) -> pb.LoadReport:
    return load


async def test_a_shared_system_prompt_spreads_over_a_new_worker() -> None:
    """Chat requests share the template's system prompt: the busy worker that cached it keeps
    requests only while the prefix saves more than the work it holds; a new worker gets its share."""
    pool = await make_pool("prefix_aware", [(0, 0)])
    old = pool.workers[0]
    system = list(range(48))  # 3 shared blocks, then each request's own text
    prompts = [[*system, *range(1000 + 40 * i, 1040 + 40 * i)] for i in range(16)]
    try:
        for p in prompts[:8]:  # the old worker serves 8 long-running streams
            pool.acquire(old, block_hashes(p, 16))
        old.load, old.sent_since_report = report(0, 8, used_blocks=8 * 6), 0
        new = pool.add("127.0.0.1:9")  # registered; its first report says it serves
        new.healthy, new.load = True, report(0, 0)
        got = []
        for p in prompts[8:]:
            pick = pool.pick(block_hashes(p, 16), prompt_tokens=len(p))
            assert pick is not None
            pool.acquire(pick.worker, block_hashes(p, 16))
            got.append(pick.worker.target)
        assert got.count(new.target) >= 4, got
    finally:
        await pool.close()


async def test_unhealthy_workers_are_skipped_and_saturation_counts_healthy_ones_only() -> None:
    pool = await make_pool("least_loaded", [(0, 0), (5, 0)])
    try:
        down = WorkerError("127.0.0.1:1", "unavailable", "UNAVAILABLE: connection refused", down=True)
        assert is_down(down)
        assert not is_down(WorkerError("127.0.0.1:1", "invalid", "INVALID_ARGUMENT: bad"))
        pool.workers[0].prefix.insert([1, 2, 3])
        pool.mark_failed(pool.workers[0], down)
        assert not pool.workers[0].healthy and len(pool.workers[0].prefix) == 0
        pick = pool.pick()
        assert pick is not None and pick.worker is pool.workers[1]
        assert pool.saturated(max_waiting=5) and not pool.saturated(max_waiting=6)
        pool.mark_failed(pool.workers[1], down)
        assert pool.pick() is None and not pool.saturated(max_waiting=1)
    finally:
        await pool.close()


async def test_a_refresh_marks_an_unreachable_worker_unhealthy() -> None:
    pool = WorkerPool("prefill", ["127.0.0.1:1"], PoolOptions(load_timeout_s=2.0))
    try:
        await pool.refresh()
        assert not pool.workers[0].healthy and pool.workers[0].last_error
    finally:
        await pool.close()


def test_pool_options_are_validated() -> None:
    with pytest.raises(ValueError, match="policy"):
        PoolOptions(policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="refresh_s"):
        PoolOptions(refresh_s=0)


def test_cpu_lists_parse_and_unavailable_cpus_are_refused() -> None:
    import os

    from services.up.specs import parse_cpus

    assert parse_cpus(None) is None and parse_cpus("") is None
    first = min(os.sched_getaffinity(0))
    assert parse_cpus(str(first)) == {first}
    assert parse_cpus(f"{first}-{first}") == {first}
    with pytest.raises(ValueError, match="not available"):
        parse_cpus("4096")
    with pytest.raises(ValueError, match="numbers and ranges"):
        parse_cpus("a-b")


async def test_late_load_reports_mark_a_worker_unhealthy_only_when_they_keep_coming_late() -> None:
    import asyncio

    pool = WorkerPool("decode", ["127.0.0.1:1"], PoolOptions(load_timeout_s=0.01, missed_reports_unhealthy=3))
    w = pool.workers[0]
    answer_after = [1.0]

    async def load() -> pb.LoadReport:
        await asyncio.sleep(answer_after[0])
        return report(0, 1)

    w.client.load = load  # type: ignore[method-assign]
    try:
        await pool.refresh()
        await pool.refresh()
        assert w.healthy and w.missed_reports == 2  # a busy worker answering late is not dead
        await pool.refresh()
        assert not w.healthy and "load report failed" in w.last_error
        answer_after[0] = 0.0
        await pool.refresh()
        assert w.healthy and w.missed_reports == 0 and w.load is not None and w.load.num_running == 1
    finally:
        await pool.close()


async def test_dns_targets_expand_to_every_address_and_follow_changes() -> None:
    answers = {"prefill": ["10.0.0.2", "10.0.0.1"]}

    async def resolver(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError(f"unknown host {host}")
        return answers[host]

    pool = WorkerPool("prefill", ["dns:prefill:50051", "127.0.0.1:7"], resolver=resolver)
    try:
        await pool.resolve()
        assert sorted(w.target for w in pool.workers) == ["10.0.0.1:50051", "10.0.0.2:50051", "127.0.0.1:7"]
        answers["prefill"] = ["10.0.0.2", "10.0.0.3"]  # a replica went away, another came
        busy = pool.find("10.0.0.1:50051")
        assert busy is not None
        busy.inflight = 1
        await pool.resolve()
        assert busy.draining and pool.find("10.0.0.3:50051") is not None
        busy.inflight = 0
        await pool.resolve()  # drained and idle: removed; a static target never is
        assert sorted(w.target for w in pool.workers) == ["10.0.0.2:50051", "10.0.0.3:50051", "127.0.0.1:7"]
        del answers["prefill"]
        await pool.resolve()  # resolution failing keeps what was known
        assert len(pool.workers) == 3
    finally:
        await pool.close()


async def test_finished_requests_do_not_inflate_the_estimate_while_reports_are_late() -> None:
    pool = await make_pool("least_loaded", [(0, 0)])
    w = pool.workers[0]
    try:
        for _ in range(500):  # many short requests, no new report in between
            pool.release(pool.acquire(w))
        assert w.sent_since_report == 500 and w.waiting == 0 and not pool.saturated(max_waiting=64)
        pool.acquire(w)
        assert w.waiting == 1 and pool.saturated(max_waiting=1)
    finally:
        await pool.close()


async def test_a_worker_that_says_it_does_not_serve_is_unhealthy_and_its_calls_are_told() -> None:
    told: list[tuple[str, str, bool]] = []

    def on_unhealthy(w: WorkerState, why: str, down: bool) -> None:
        told.append((w.target, why, down))

    pool = WorkerPool("decode", ["127.0.0.1:1"], on_unhealthy=on_unhealthy)
    w = pool.workers[0]
    answer = [report(0, 0, instance="a")]

    async def load() -> pb.LoadReport:
        return answer[0]

    w.client.load = load  # type: ignore[method-assign]
    try:
        await pool.refresh()
        assert w.healthy and w.instance == "a"
        w.prefix.insert([1, 2])
        answer[0] = pb.LoadReport(serving=False, not_serving_reason="engine core silent for 3.2 s",
                                  instance_id="a")
        await pool.refresh()
        assert not w.healthy and told == [(w.target, "not serving: engine core silent for 3.2 s", False)]
        answer[0] = report(0, 0, instance="a")
        await pool.refresh()
        assert w.healthy and len(told) == 1
        w.prefix.insert([1, 2])
        answer[0] = report(0, 0, instance="b")  # restarted between two reports
        await pool.refresh()
        assert w.healthy and w.instance == "b" and len(w.prefix) == 0
        pool.mark_failed(w, WorkerError(w.target, "unavailable", "UNAVAILABLE: reset", down=True))
        assert told[-1] == (w.target, "UNAVAILABLE: reset", True)  # unreachable: streams end too
    finally:
        await pool.close()


async def test_a_hybrid_models_pages_count_as_their_share_of_every_layer() -> None:
    """Gemma 3 270M's blocks are pages of 3 of its 18 layers (engine/core/kv_layout.py): 60 pages
    in use hold 160 tokens of every layer, not 960; an older worker's report (no share) counts
    whole blocks."""
    pool = await make_pool("prefix_aware", [(0, 0)])
    worker = pool.workers[0]
    answer = report(0, 1, used_blocks=60)
    answer.block_layer_share = 3 / 18
    worker.client.load = lambda: _answer(answer)  # type: ignore[method-assign]
    try:
        await pool.refresh()
        assert worker.held_tokens(16, 62) == 160
        answer.block_layer_share = 0.0
        await pool.refresh()
        assert worker.held_tokens(16, 62) == 960
    finally:
        await pool.close()
