"""Chaos run: steady streaming chat load through `pdserve up` while a schedule kills, freezes and
restarts each kind of component, then an audit. Bounded (requests, seconds) and loopback only.

    python -m loadtest.chaos --prefill 2 --decode 2 --users 8 --out chaos-out
    python -m loadtest.chaos --faults kill:decode,freeze:store --settle-s 5 ...

Every request is greedy, so each prompt has one right answer: the text of its first run, before
any fault. Per fault the report gives the requests in flight when it struck, those completed and
failed (client-visible errors) until the next fault, hung ones (past --request-timeout-s), wrong
texts, and the seconds until the pools were whole again (every component running, every worker
healthy in the router). The audit after the load: every worker idle with no KV block in use,
leased store objects back to 0 once leases expire, no process of the run left after `pdserve up`
stopped, no store directory left in /dev/shm. Writes DIR/chaos.json and DIR/requests.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from openai.types.chat import ChatCompletionMessageParam

from loadtest.chaos_system import Fault, System, shm_leftovers

DEFAULT_FAULTS = ("kill:decode,freeze:prefill,kill:core:decode,freeze:decode,kill:prefill,freeze:kvstore,"
                  "kill:kvstore,restart:decode,freeze:core:prefill,restart:prefill,restart:kvstore,"
                  "freeze:router,kill:router,restart:router")
SYSTEM = "You are a concise assistant. Answer in one or two short sentences."
PROMPTS = 16
TOPICS = ["the sea", "a lighthouse", "trains", "bread", "the moon", "rivers", "glass", "bees", "maps",
          "winter", "clocks", "salt", "bridges", "paper", "volcanoes", "owls"]


@dataclass
class Record:
    prompt: int
    start: float
    end: float = 0.0
    ok: bool = False
    error: str = ""
    text: str = ""
    tokens: int = 0


@dataclass
class FaultReport:
    fault: str
    struck: str = ""
    at: float = 0.0
    in_flight: int = 0
    completed: int = 0
    errors: int = 0
    wrong: int = 0
    whole_after_s: float | None = None
    error_samples: list[str] = field(default_factory=list)


class Load:
    """`users` chat users, each sending one streamed request after another."""

    def __init__(self, url: str, model: str, users: int, max_tokens: int, timeout_s: float,
                 retries: int) -> None:
        import openai

        self.client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=retries,
                                         timeout=timeout_s)
        self.model, self.users, self.max_tokens, self.timeout_s = model, users, max_tokens, timeout_s
        self.records: list[Record] = []
        self.answers: dict[int, str] = {}  # each prompt's undisturbed text
        self.stopping = False
        self.next = 0

    def messages(self, i: int) -> list[ChatCompletionMessageParam]:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Tell me one fact about {TOPICS[i % len(TOPICS)]}."}]

    async def one(self, i: int) -> Record:
        rec = Record(i % PROMPTS, time.monotonic())
        self.records.append(rec)
        try:
            async with asyncio.timeout(self.timeout_s):
                stream = await self.client.chat.completions.create(
                    model=self.model, messages=self.messages(rec.prompt), max_tokens=self.max_tokens,
                    temperature=0, stream=True)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        rec.text += chunk.choices[0].delta.content
                        rec.tokens += 1
            rec.ok = True
        except TimeoutError:
            rec.error = f"hung: no end after {self.timeout_s:.0f} s"
        except Exception as e:
            rec.error = f"{type(e).__name__}: {e}"[:300]
        rec.end = time.monotonic()
        return rec

    async def user(self, max_requests: int) -> None:
        while not self.stopping and self.next < max_requests:
            self.next += 1
            if not (await self.one(self.next - 1)).ok:
                await asyncio.sleep(1.0)  # as a client would, not a retry storm

    async def warm_up(self, prompts: int) -> None:
        """Each prompt once, undisturbed: the right answers."""
        recs = await asyncio.gather(*(self.one(i) for i in range(prompts)))
        for rec in recs:
            if not rec.ok:
                raise RuntimeError(f"warm-up request failed: {rec.error}")
            self.answers[rec.prompt] = rec.text
        self.records.clear()
        self.next = 0

    def in_flight(self) -> int:
        return sum(1 for r in self.records if not r.end)


async def run(args: argparse.Namespace) -> dict[str, object]:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    shm_before = set(shm_leftovers())
    faults = [Fault.parse(f) for f in args.faults.split(",") if f]  # bad ones fail before anything starts
    system = System(args.model, args.prefill, args.decode, out, args.up_arg)
    reports: list[FaultReport] = []
    load: Load | None = None
    try:
        await asyncio.to_thread(system.wait_up, args.startup_timeout_s)
        load = Load(system.url, args.model, args.users, args.max_tokens, args.request_timeout_s,
                    args.client_retries)
        await load.warm_up(PROMPTS)
        users = [asyncio.create_task(load.user(args.max_requests)) for _ in range(args.users)]
        deadline = time.monotonic() + args.max_duration_s
        await asyncio.sleep(args.settle_s)
        for fault in faults:
            if time.monotonic() > deadline or all(u.done() for u in users):
                break
            reports.append(await strike(system, load, fault, args))
        while load.next < args.min_requests and time.monotonic() < deadline:
            if all(u.done() for u in users):
                break
            await asyncio.sleep(0.5)
        load.stopping = True
        await asyncio.wait_for(asyncio.gather(*users), timeout=args.request_timeout_s + 30)
        attribute(load, reports)
        audit = await asyncio.to_thread(run_audit, system, args)
    finally:
        if load is not None:
            await load.client.close()
        code = system.stop()
    audit["up_exit_code"] = code
    audit["orphan_pids"] = system.orphans()
    audit["shm_left"] = sorted(set(shm_leftovers()) - shm_before)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "faults": [asdict(r) for r in reports],
              "totals": totals(load), "restarts": audit.pop("restarts"), "audit": audit}
    (out / "chaos.json").write_text(json.dumps(result, indent=1))
    with open(out / "requests.jsonl", "w") as f:
        for rec in load.records if load else []:
            f.write(json.dumps(asdict(rec)) + "\n")
    return result


async def strike(system: System, load: Load, fault: Fault, args: argparse.Namespace) -> FaultReport:
    """Strikes, waits until the pools are whole again (at most --whole-timeout-s), then lets the
    load run --settle-s more: the next fault meets a healthy worker of each role."""
    rep = FaultReport(str(fault), at=time.monotonic(), in_flight=load.in_flight())
    try:
        rep.struck = await asyncio.to_thread(system.strike, fault, args.freeze_s)
    except (OSError, RuntimeError, ValueError) as e:  # e.g. a worker with no engine core right now
        rep.struck = f"not struck: {e}"
        print(f"{fault}: {rep.struck}", flush=True)
        return rep
    print(f"{fault} struck {rep.struck} ({rep.in_flight} requests in flight, {load.next} sent)", flush=True)
    await asyncio.sleep(1.0)  # let the pools notice before asking whether they are whole
    end = rep.at + args.whole_timeout_s
    while time.monotonic() < end:
        if await asyncio.to_thread(system.whole):
            rep.whole_after_s = round(time.monotonic() - rep.at, 1)
            print(f"  pools whole again after {rep.whole_after_s} s", flush=True)
            break
        await asyncio.sleep(0.25)
    await asyncio.sleep(args.settle_s)
    return rep


def attribute(load: Load, reports: list[FaultReport]) -> None:
    """Each request to the fault under way when it ended (requests before the first: none)."""
    for rec in load.records:
        rep = next((r for r in reversed(reports) if r.at <= rec.end), None)
        if rep is None:
            continue
        if rec.ok:
            rep.completed += 1
            rep.wrong += rec.text != load.answers.get(rec.prompt, rec.text)
        else:
            rep.errors += 1
            if len(rep.error_samples) < 3:
                rep.error_samples.append(rec.error)


def totals(load: Load | None) -> dict[str, object]:
    recs = load.records if load else []
    done = [r for r in recs if r.ok]
    return {"requests": len(recs), "completed": len(done), "errors": sum(not r.ok for r in recs),
            "hung": sum(r.error.startswith("hung") for r in recs),
            "wrong": sum(r.text != load.answers.get(r.prompt, r.text) for r in done) if load else 0,
            "max_seconds": round(max((r.end - r.start for r in recs), default=0.0), 1)}


def run_audit(system: System, args: argparse.Namespace) -> dict[str, object]:
    workers = system.audit_workers(timeout_s=60)
    leased = system.audit_leases(timeout_s=args.lease_wait_s)
    return {"workers": workers, "leased_after_expiry": leased, "restarts": system.restarts()}


def print_report(result: dict[str, object]) -> None:
    print("| fault | struck | in flight | completed | errors | wrong | whole after (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in result["faults"]:  # type: ignore[attr-defined]
        whole = "-" if r["whole_after_s"] is None else r["whole_after_s"]
        print(f"| {r['fault']} | {r['struck']} | {r['in_flight']} | {r['completed']} | {r['errors']} | "
              f"{r['wrong']} | {whole} |")
    print(f"totals: {result['totals']}")
    print(f"restarts: {result['restarts']}")
    print(f"audit: {result['audit']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--faults", default=DEFAULT_FAULTS, help="comma-separated action:component")
    p.add_argument("--settle-s", type=float, default=10.0,
                   help="load time between the pools being whole again and the next fault")
    p.add_argument("--whole-timeout-s", type=float, default=180.0,
                   help="how long a fault's recovery is waited for before the next fault")
    p.add_argument("--freeze-s", type=float, default=8.0)
    p.add_argument("--min-requests", type=int, default=200, help="the load runs at least this many")
    p.add_argument("--max-requests", type=int, default=2000)
    p.add_argument("--max-duration-s", type=float, default=1500.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="a request's bound")
    p.add_argument("--client-retries", type=int, default=2,
                   help="the openai client's retries of failed connections (its default: 2)")
    p.add_argument("--lease-wait-s", type=float, default=90.0, help="how long the audit waits for leases")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.add_argument("--up-arg", action="append", default=[], help="an extra `pdserve up` argument")
    p.add_argument("--out", type=Path, default=Path("chaos-out"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    print_report(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
