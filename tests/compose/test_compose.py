"""`docker compose up` for real: the stack of compose.yaml (redis, kvstore, model, prefill, decode,
router) answers the official `openai` client on 127.0.0.1, and keeps answering when the prefill
container dies under load (the router retries, then lets the decode worker compute the prompt).

Run with `make test-compose` (or PDSERVE_RUN_COMPOSE=1 after docker/install_docker.sh and
docker/build_images.sh)."""

from __future__ import annotations

import re
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.compose.stack import ComposeStack

pytestmark = [pytest.mark.compose, pytest.mark.timeout(900)]

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 180.0


def _client(stack: ComposeStack, api_key: str | None = None) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key=api_key or stack.api_key,
                  timeout=REQUEST_TIMEOUT_S, max_retries=0)


def _get(stack: ComposeStack, path: str) -> str:
    with urllib.request.urlopen(f"{stack.base_url}{path}", timeout=10) as resp:
        return str(resp.read().decode())


def _decisions(stack: ComposeStack) -> dict[str, float]:
    text = _get(stack, "/metrics")
    return {m[0]: float(m[1]) for m in
            re.findall(r'^pdserve:router_decisions_total\{[^}]*decision="(\w+)"[^}]*\} (\S+)$', text, re.M)}


def test_up_publishes_only_on_loopback(compose_stack: ComposeStack) -> None:
    ps = compose_stack.compose("ps", "--format", "{{.Service}} {{.State}} {{.Ports}}").stdout
    services = {line.split()[0]: line for line in ps.splitlines() if line.strip()}
    assert {"redis", "kvstore", "prefill", "decode", "router"} <= set(services), ps
    assert all(" running" in services[s] for s in ("redis", "kvstore", "prefill", "decode", "router")), ps
    assert f"127.0.0.1:{compose_stack.port}->8000/tcp" in services["router"], ps
    assert "0.0.0.0:" not in ps and "[::]:" not in ps, ps  # nothing published on other interfaces
    health = _get(compose_stack, "/health")
    assert '"prefill":{"healthy":1,"workers":1}' in health.replace(" ", ""), health


def test_only_the_router_port_is_published_and_the_backend_is_internal(compose_stack: ComposeStack) -> None:
    """Docker's own view (inspect), not compose's summary: no container but the router has a
    host port binding, and redis / the store / the workers sit on an internal network only."""
    import json

    ids = compose_stack.compose("ps", "-q").stdout.split()
    info = json.loads(subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True,
                                     check=True, timeout=60).stdout)
    published = {}
    for c in info:
        service = c["Config"]["Labels"]["com.docker.compose.service"]
        bindings = {port: b for port, b in (c["HostConfig"].get("PortBindings") or {}).items() if b}
        published[service] = bindings
        nets = set(c["NetworkSettings"]["Networks"])
        if service != "router":
            assert nets == {f"{compose_stack.project}_backend"}, (service, nets)
    assert {s for s, b in published.items() if b} == {"router"}, published
    assert [(b["HostIp"], b["HostPort"]) for b in published["router"]["8000/tcp"]] == [
        ("127.0.0.1", str(compose_stack.port))]
    net = json.loads(subprocess.run(["docker", "network", "inspect", f"{compose_stack.project}_backend"],
                                    capture_output=True, text=True, check=True, timeout=60).stdout)
    assert net[0]["Internal"] is True, net


_PROBE = """
import os, grpc
from kvstore.client import KVStoreAuthError, KVStoreClient
from protos import worker_pb2 as pb, worker_pb2_grpc as pb_grpc
print("files", sorted(os.listdir("/run/pdserve-secrets")))
try:
    KVStoreClient("grpc://kvstore:50071", token="", use_shm=False).stats()
    print("store open")
except KVStoreAuthError:
    print("store refused")
try:
    stub = pb_grpc.WorkerStub(grpc.insecure_channel("prefill:50051"))
    stub.Abort(pb.AbortRequest(request_id="x"), timeout=10)
    print("worker open")
except grpc.RpcError as e:
    print("worker", e.code().name)
"""


def test_credentials_are_per_component_and_required(compose_stack: ComposeStack) -> None:
    """From inside the router's container (the one facing clients): it holds only the workers'
    token; the store and a worker refuse a caller that presents nothing."""
    out = compose_stack.compose("exec", "-T", "router", "python", "-c", _PROBE, timeout_s=120).stdout
    assert "files ['worker-token']" in out, out
    assert "store refused" in out and "worker UNAUTHENTICATED" in out, out
    worker = compose_stack.compose("exec", "-T", "prefill", "ls", "/run/pdserve-secrets").stdout.split()
    assert sorted(worker) == ["kv-integrity-key", "kv-worker-token", "worker-token"], worker


def test_api_key_is_required(compose_stack: ComposeStack) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(compose_stack, api_key="wrong").models.list()
    assert [m.id for m in _client(compose_stack).models.list().data] == [MODEL]


def test_completions_streamed_and_not(compose_stack: ComposeStack) -> None:
    client = _client(compose_stack)
    prompt = "The three primary colors are"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    text = full.choices[0].text
    assert text.strip(), full
    assert full.usage is not None and full.usage.prompt_tokens > 0, full
    assert full.usage.completion_tokens == MAX_TOKENS or full.choices[0].finish_reason == "stop", full

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == text  # greedy: the same tokens, streamed or not
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_streamed_and_not(compose_stack: ComposeStack) -> None:
    client = _client(compose_stack)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "What is the capital of France? Answer in one word."}]
    full = client.chat.completions.create(model=MODEL, messages=messages,
                                          max_tokens=MAX_TOKENS, temperature=0)
    answer = full.choices[0].message.content or ""
    assert full.choices[0].message.role == "assistant"
    assert "paris" in answer.lower(), answer
    assert full.usage is not None and full.usage.prompt_tokens > 10  # the chat template's tokens too

    stream = client.chat.completions.create(model=MODEL, messages=messages,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == answer
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


@dataclass
class _Result:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: BaseException | None = None
    done_at: float = field(default=0.0)


def _stream_one(client: OpenAI, index: int, out: _Result) -> None:
    # Distinct, long-ish prompts (no shared prefix): each is still being prefilled when the
    # prefill worker dies a moment after they are sent.
    prompt = f"Note {index}: " + " ".join(f"item{index}-{j}" for j in range(250)) + "\nSummary:"
    try:
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices:
                out.text += chunk.choices[0].text
                out.finish_reason = chunk.choices[0].finish_reason or out.finish_reason
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
    except BaseException as exc:  # reported by the test thread
        out.error = exc
    finally:
        out.done_at = time.monotonic()


def _workers(stack: ComposeStack, role: str) -> list[dict[str, object]]:
    import json

    req = urllib.request.Request(f"{stack.base_url}/admin/workers",
                                 headers={"Authorization": f"Bearer {stack.api_key}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return [w for w in json.loads(resp.read())["workers"] if w["role"] == role]


def test_docker_actuator_adds_a_replica_the_router_finds_and_drains_it_away(
        compose_stack: ComposeStack) -> None:
    """The autoscaler's Docker actuator clones the prefill replica through the Engine API; the
    router's dns: discovery adds it; draining then stopping it leaves one prefill worker."""
    import asyncio

    import httpx

    from services.autoscaler.docker_actuator import DockerActuator

    async def scenario() -> None:
        actuator = DockerActuator(compose_stack.project, startup_timeout_s=300)
        headers = {"Authorization": f"Bearer {compose_stack.api_key}"}
        try:
            target = await actuator.start("prefill")
            deadline = time.monotonic() + 60
            while not any(w["target"] == target and w["healthy"] for w in _workers(compose_stack, "prefill")):
                assert time.monotonic() < deadline, _workers(compose_stack, "prefill")
                await asyncio.sleep(0.5)
            assert len(_workers(compose_stack, "prefill")) == 2
            ps = compose_stack.compose("ps", "--format", "{{.Name}}", "prefill").stdout.split()
            assert len(ps) == 2  # compose sees the new replica as one of its own
            out = _client(compose_stack).completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                                            temperature=0)
            assert out.choices[0].text
            async with httpx.AsyncClient(base_url=compose_stack.base_url, headers=headers) as http:
                body = {"role": "prefill", "target": target}
                assert (await http.post("/admin/workers/drain", json=body)).status_code == 200
                assert (await http.post("/admin/workers/remove", json=body)).status_code == 200
            await actuator.stop("prefill", target)
            assert [w["target"] for w in _workers(compose_stack, "prefill")] != [target]
            assert len(_workers(compose_stack, "prefill")) == 1
            assert actuator.managed("prefill") == []
        finally:
            await actuator.stop_all()
            await actuator.close()

    asyncio.run(scenario())


def test_requests_survive_prefill_kill(compose_stack: ComposeStack) -> None:
    """Runs last in this module: it kills the prefill container."""
    client = _client(compose_stack)
    before = _decisions(compose_stack)
    results = [_Result() for _ in range(4)]
    threads = [threading.Thread(target=_stream_one, args=(client, i, r), daemon=True)
               for i, r in enumerate(results)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    killed_at = time.monotonic()
    compose_stack.compose("kill", "-s", "SIGKILL", "prefill", timeout_s=60)
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT_S + 30)
    assert not any(t.is_alive() for t in threads), "a request did not finish in time"
    assert sum(r.done_at > killed_at for r in results) >= 1, "every request finished before the kill"
    for r in results:
        assert r.error is None, f"{r.error!r}\n{compose_stack.logs()}"
        assert r.text.strip() and r.finish_reason in ("length", "stop"), r
        assert r.completion_tokens == MAX_TOKENS or r.finish_reason == "stop", r

    after = _decisions(compose_stack)
    assert after.get("fallback", 0) > before.get("fallback", 0), (before, after)
    health = _get(compose_stack, "/health").replace(" ", "")
    assert '"prefill":{"healthy":0,"workers":1}' in health, health  # the router noticed

    # With no prefill worker at all, a new request goes straight to the decode worker.
    late = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=MAX_TOKENS,
                                     temperature=0)
    assert late.choices[0].text.strip(), late
