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
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.multihost import Fleet, FleetSpec
from loadtest.netns import Hosts, unavailable

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


# A client of the store (the workers' credential): puts one object, reads it back, says whether
# it saw the store's shared-memory directory.
CLIENT = textwrap.dedent("""
    import sys, torch
    from kvstore.client import KVStoreClient
    from kvstore.lmcache_format import CacheEngineKey, MemoryFormat, RemoteMetadata, tensor_to_buffer
    url, token, chunk = sys.argv[1], open(sys.argv[2]).read().strip(), int(sys.argv[3])
    key = CacheEngineKey("tiny", 1, 0, chunk, "float32").layer(0).to_string()
    t = torch.arange(4096, dtype=torch.float32).reshape(16, 2, 128)
    meta = RemoteMetadata.single(tuple(t.shape), t.dtype, MemoryFormat.KV_T2D).pack()
    with KVStoreClient(url, token=token) as c:
        c.put([(key, meta, tensor_to_buffer(t))])
        (got,) = c.get([key])
        assert got is not None and bytes(got.data) == t.numpy().tobytes()
        print("shm" if c.shm_dir() else "flight")
""")


def _client_on(fleet: Fleet, host: Any | None, chunk: int) -> str:
    argv = [sys.executable, "-c", CLIENT, fleet.store_url, fleet.secrets.path("kv-worker-token"),
            str(chunk)]
    out = subprocess.run(host.argv(argv) if host is not None else argv, cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_shared_memory_only_where_client_and_store_share_a_host(fleet: Fleet) -> None:
    _all(fleet.base_url, SAMPLINGS["greedy"], stream=False)  # KV handed over, whatever ran before
    before = _store_metrics(fleet)
    assert before["pdserve_kvstore_put_objects_total"] > 0  # the workers' KV went through the store
    assert before["pdserve_kvstore_shm_put_objects_total"] == 0  # ... over the network only
    assert before["pdserve_kvstore_shm_get_objects_total"] == 0

    assert _client_on(fleet, None, chunk=0x1111) == "flight"  # this host: the root namespace
    after_other = _store_metrics(fleet)
    assert after_other["pdserve_kvstore_shm_put_objects_total"] == 0

    assert _client_on(fleet, fleet.host_of("kvstore"), chunk=0x2222) == "shm"  # the store's host
    after_same = _store_metrics(fleet)
    assert after_same["pdserve_kvstore_shm_put_objects_total"] == 1
    assert after_same["pdserve_kvstore_shm_get_objects_total"] == 1
