"""The disaggregated system across hosts: the KV store, two prefill workers, two decode workers
and the router, each a `pdserve` process on a host of its own (loadtest/netns.py: a network
namespace with its own address on a bridge this test makes, and its own /dev/shm), with the
credentials a deployment has. Nothing can take a shortcut: every call goes over the bridge,
and the store's same-host path cannot find its files from another host.

- Requests through the router equal the offline engine's (colocated) output token for token
  (greedy and seeded sampling), and every worker of both pools served some of them.
- The KV went over the network: the store's shared-memory counters stay at zero for clients on
  other hosts, while a client on the store's own host does use shared memory.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.multihost import Fleet, FleetSpec
from loadtest.netns import Hosts, unavailable
from tests.integration.multihost.store_client import put_and_get

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"multi-host test: {REASON}")
in_module_loop = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parents[3]
TINY_ENGINE = ("--num-threads", "1", "--max-model-len", "512", "--num-kv-blocks", "96", "--grace-s", "2")
MODEL = "tiny"
NEW = 12
# Prompts longer than a KV block (16) so prefill hands real KV blocks over through the store.
PROMPTS = [[200 + 37 * i + 5 * j for j in range(20 + 3 * i)] for i in range(8)]
SAMPLINGS: dict[str, dict[str, Any]] = {"greedy": {"temperature": 0.0},
                                        "seeded": {"temperature": 1.0, "seed": 1234}}


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with Hosts(FleetSpec(model="").num_hosts) as made:
        yield made


@pytest.fixture(scope="module")
def fleet(hosts: Hosts, tiny_model_dir: Callable[[str], Path]) -> Iterator[Fleet]:
    spec = FleetSpec(model=str(tiny_model_dir("llama")), served_name=MODEL, engine_args=TINY_ENGINE,
                     router_args=("--policy", "least_loaded", "--max-model-len", "512"))
    with Fleet(spec, hosts) as running:
        yield running


@pytest.fixture(scope="module")
def colocated(tiny_model_dir: Callable[[str], Path]) -> dict[str, list[tuple[str, list[str]]]]:
    """The reference: the offline engine (the whole model in one process, no KV transfer), per
    sampling: (text, each generated token as the router renders it) per prompt."""
    from engine.detokenizer import decode_token
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    out = {}
    with LLM(model=str(tiny_model_dir("llama")), num_threads=1, max_model_len=512,
             num_kv_blocks=96) as llm:
        tok = llm.get_tokenizer()
        for name, sampling in SAMPLINGS.items():
            params = SamplingParams(max_tokens=NEW, ignore_eos=True, **sampling)
            done = llm.generate(PROMPTS, params, use_tqdm=False)
            out[name] = [(o.outputs[0].text, [decode_token(tok, t) for t in o.outputs[0].token_ids])
                         for o in done]
    return out


async def _complete(base_url: str, prompt: list[int], sampling: dict[str, Any], stream: bool
                    ) -> tuple[str, list[str], str | None]:
    """(text, one token string per generated token, finish reason) of one completion."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60) as client:
        kw = {"model": MODEL, "prompt": prompt, "max_tokens": NEW, "logprobs": 1,
              "extra_body": {"ignore_eos": True}, **sampling}
        if not stream:
            out = await client.completions.create(**kw)
            lp = out.choices[0].logprobs
            return out.choices[0].text, list(lp.tokens or []) if lp else [], out.choices[0].finish_reason
        text, tokens, finish = "", [], None
        async for chunk in await client.completions.create(**kw, stream=True):
            for choice in chunk.choices:
                text += choice.text
                tokens += (choice.logprobs.tokens or []) if choice.logprobs else []
                finish = choice.finish_reason or finish
        return text, tokens, finish


def _all(base_url: str, sampling: dict[str, Any], stream: bool) -> list[Any]:
    async def run() -> list[Any]:
        return await asyncio.gather(*(_complete(base_url, p, sampling, stream) for p in PROMPTS))

    return asyncio.run(run())


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_router_across_hosts_equals_colocated_token_for_token(
        fleet: Fleet, colocated: dict[str, list[tuple[str, list[str]]]], sampling: str) -> None:
    stream = sampling == "seeded"  # one of each path through the router
    across = _all(fleet.base_url, SAMPLINGS[sampling], stream)
    for (text, tokens, finish), (want_text, want_tokens) in zip(across, colocated[sampling], strict=True):
        assert len(tokens) == NEW and finish == "length"
        assert tokens == want_tokens
        assert text == want_text


def test_every_worker_of_both_pools_served(fleet: Fleet) -> None:
    _all(fleet.base_url, SAMPLINGS["greedy"], stream=False)
    workers = httpx.get(f"{fleet.router_url}/admin/workers", timeout=10,
                        headers={"Authorization": f"Bearer {fleet.admin_key}"}).json()["workers"]
    dispatched = {w["target"]: (w["role"], w["dispatched"]) for w in workers}
    for kind in ("prefill", "decode"):
        for comp in fleet.by_kind(kind):
            role, count = dispatched[comp.address]
            assert role == kind and count > 0, dispatched
    # Every sample was prefilled on a prefill host and decoded on a decode host: none fell back
    # to computing its prompt on the decode worker.
    metrics = {(s.name, s.labels.get("decision")): s.value for fam in text_string_to_metric_families(
        httpx.get(f"{fleet.router_url}/metrics", timeout=10).text) for s in fam.samples}
    assert metrics[("pdserve:router_decisions_total", "disaggregated")] >= len(PROMPTS)
    assert metrics.get(("pdserve:router_decisions_total", "fallback"), 0) == 0


def test_each_component_runs_on_a_host_of_its_own(fleet: Fleet) -> None:
    """Network and mount namespaces: six different ones, none of them this process's."""
    for ns in ("net", "mnt"):
        mine = os.readlink(f"/proc/self/ns/{ns}")
        theirs = {os.readlink(f"/proc/{c.proc.pid}/ns/{ns}") for c in fleet.components}
        assert len(theirs) == len(fleet.components) and mine not in theirs, (ns, theirs)


def _store_metrics(fleet: Fleet) -> dict[str, float]:
    from kvstore.client import KVStoreClient

    token = Path(fleet.secrets.path("kv-admin-token")).read_text().strip()
    with KVStoreClient(fleet.store_url, token=token, use_shm=False) as admin:
        text = admin.metrics_text()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def _client_on_store_host(fleet: Fleet, chunk: int) -> str:
    """store_client.py run on the store's own host (its network and mount namespaces)."""
    argv = [sys.executable, "-m", "tests.integration.multihost.store_client", fleet.store_url,
            fleet.secrets.path("kv-worker-token"), str(chunk)]
    host = fleet.host_of("kvstore")
    assert host is not None
    out = subprocess.run(host.argv(argv), cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_shared_memory_only_where_client_and_store_share_a_host(fleet: Fleet) -> None:
    _all(fleet.base_url, SAMPLINGS["greedy"], stream=False)  # KV handed over, whatever ran before
    before = _store_metrics(fleet)
    # Prefill hosts put KV, decode hosts got it, over the network only.
    assert before["pdserve_kvstore_put_objects_total"] > 0
    assert before["pdserve_kvstore_get_bytes_total"] > 0 and before["pdserve_kvstore_hits"] > 0
    assert before["pdserve_kvstore_shm_put_objects_total"] == 0
    assert before["pdserve_kvstore_shm_get_objects_total"] == 0

    worker_token = Path(fleet.secrets.path("kv-worker-token")).read_text().strip()
    assert put_and_get(fleet.store_url, worker_token, chunk=0x1111) == "flight"  # from this host
    after_other = _store_metrics(fleet)
    assert after_other["pdserve_kvstore_shm_put_objects_total"] == 0

    assert _client_on_store_host(fleet, chunk=0x2222) == "shm"
    after_same = _store_metrics(fleet)
    assert after_same["pdserve_kvstore_shm_put_objects_total"] == 1
    assert after_same["pdserve_kvstore_shm_get_objects_total"] == 1


def test_what_a_crashed_run_left_behind_is_removed() -> None:
    """Namespaces, bridge, veth and FORWARD rule named for a pid that is gone (beyond pid_max)."""
    import subprocess as sp

    from loadtest.netns import remove_leftovers

    dead = "4194999"
    _delete_fake_leftovers(dead)  # an earlier run of this test that died half-way
    sp.run(["ip", "netns", "add", f"pdmh-{dead}-0"], check=True)
    sp.run(["ip", "link", "add", f"pdmh{dead}b", "type", "bridge"], check=True)
    sp.run(["ip", "link", "add", f"pdmh{dead}v0", "type", "veth", "peer", "name", f"pdmh{dead}p0"],
           check=True)
    rule = ["FORWARD", "-i", f"pdmh{dead}b", "-o", f"pdmh{dead}b", "-m", "comment", "--comment",
            f"pdmh-{dead}", "-j", "ACCEPT"]
    # No iptables (a machine without Docker): no FORWARD rule is ever made, so none to remove.
    has_iptables = (shutil.which("iptables") is not None
                    and sp.run(["iptables", "-I", *rule], capture_output=True).returncode == 0)
    try:
        removed = remove_leftovers()
        assert f"pdmh-{dead}-0" in removed and f"pdmh{dead}b" in removed and f"pdmh{dead}v0" in removed
        assert f"pdmh-{dead}" not in sp.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"pdmh{dead}" not in sp.run(["ip", "link", "show"], capture_output=True, text=True).stdout
        if has_iptables:
            rules = sp.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout
            assert f"pdmh-{dead}" not in rules
    finally:
        _delete_fake_leftovers(dead)
        if has_iptables:
            sp.run(["iptables", "-D", *rule], capture_output=True)


def _delete_fake_leftovers(dead: str) -> None:
    for cmd in (["ip", "netns", "del", f"pdmh-{dead}-0"], ["ip", "link", "del", f"pdmh{dead}b"],
                ["ip", "link", "del", f"pdmh{dead}v0"]):
        subprocess.run(cmd, capture_output=True)
