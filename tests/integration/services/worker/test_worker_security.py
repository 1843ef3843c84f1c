"""The worker plane's security end to end (tiny model, real KV store, real HTTP): workers with a
token refuse every RPC but health without it; a router with the token serves a split completion;
TLS and mutual TLS between router and workers; the protected-mode rule at start; the admin API's
target check; the API docs behind the API key or off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import pytest_asyncio

from kvstore.credentials import TLSFiles
from kvstore.service import KVStoreService
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc as pb_grpc
from services.cli import build_parser
from services.procs import free_port, port_free
from services.router.app import RouterConfig
from services.router.dispatch.dispatcher import DispatchOptions
from services.worker.auth import DENIED, ExposedWorkerError, WorkerAccess
from services.worker.client import WorkerClient, WorkerError
from services.worker.server import WorkerOptions, WorkerServer
from tests.integration.services.conftest import running_together, worker_options
from tests.integration.services.router_util import ServedRouter
from tests.integration.services.tls_util import Certs, make_certs

in_module_loop = pytest.mark.asyncio(loop_scope="module")

TOKEN = "worker-token-0123456789"
WRONG = "not-the-worker-token-987"
MODEL = "tiny"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def secured(model_dir: Path, store: KVStoreService, certs: Certs
                  ) -> AsyncIterator[dict[str, WorkerServer]]:
    """prefill + decode with the token; "mtls": colocated over mutual TLS (client certificates
    required), with the token too. Started together."""
    tls = TLSFiles(certs.server_cert, certs.server_key, certs.ca)
    servers = {"prefill": WorkerServer(worker_options(model_dir, store, "prefill", token=TOKEN)),
               "decode": WorkerServer(worker_options(model_dir, store, "decode", token=TOKEN)),
               "mtls": WorkerServer(worker_options(model_dir, store, "colocated", token=TOKEN, tls=tls))}
    async with running_together(servers):
        yield servers


def router_config(model_dir: Path, decode: str, prefill: str | None = None,
                  access: WorkerAccess | None = None, **kw: Any) -> RouterConfig:
    dispatch = DispatchOptions(decode=(decode,), prefill=(prefill,) if prefill else (),
                               decode_timeout_s=60, worker_access=access or WorkerAccess())
    return RouterConfig(model=MODEL, tokenizer=str(model_dir), max_model_len=512, dispatch=dispatch, **kw)


async def complete(served: ServedRouter) -> openai.types.Completion:
    async with openai.AsyncOpenAI(base_url=served.base_url, api_key="x", max_retries=0, timeout=60) as c:
        return await c.completions.create(model=MODEL, prompt="The city", max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})


async def served_completion(config: RouterConfig) -> openai.types.Completion:
    """One completion through a router on `config`, once its workers' first reports are in."""
    with ServedRouter(config) as served:
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(100):
                workers = (await http.get(f"{served.url}/admin/workers")).json()["workers"]
                if all(w["instance_id"] and w["healthy"] for w in workers):
                    break
                await asyncio.sleep(0.05)
            assert all(w["healthy"] for w in workers), workers
        out = await complete(served)
        if config.dispatch.prefill:
            assert served.metric("pdserve:router_decisions_total", decision="disaggregated") == 1
        return out


@pytest.mark.parametrize("metadata", [(), (("authorization", f"Bearer {WRONG}"),),
                                      (("authorization", WRONG),)], ids=["none", "wrong", "no-bearer"])
@in_module_loop
async def test_a_worker_with_a_token_refuses_every_rpc_but_health_without_it(
        secured: dict[str, WorkerServer], metadata: tuple[tuple[str, str], ...]) -> None:
    params = pb.SamplingParams(max_tokens=2)
    for name, call in (("prefill", lambda s: s.Prefill(pb.PrefillRequest(request_id="r", token_ids=[1, 2],
                                                                          params=params), metadata=metadata)),
                       ("decode", lambda s: s.Decode(pb.DecodeRequest(request_id="r", token_ids=[1, 2],
                                                                      params=params), metadata=metadata)),
                       ("decode", lambda s: s.Load(pb.LoadRequest(), metadata=metadata)),
                       ("prefill", lambda s: s.Abort(pb.AbortRequest(request_id="r"), metadata=metadata))):
        async with grpc.aio.insecure_channel(secured[name].target) as channel:
            reply = call(pb_grpc.WorkerStub(channel))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                if isinstance(reply, grpc.aio.UnaryStreamCall):
                    await reply.read()
                else:
                    await reply
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert err.value.details() == DENIED and WRONG not in str(err.value)
    async with WorkerClient(secured["decode"].target, WorkerAccess()) as anonymous:
        assert await anonymous.health()  # probes need no token
        assert await anonymous.health("liveness")
        with pytest.raises(WorkerError, match="UNAUTHENTICATED"):
            await anonymous.load()


@in_module_loop
async def test_a_router_with_the_worker_token_serves_a_split_completion(
        secured: dict[str, WorkerServer], model_dir: Path) -> None:
    async with WorkerClient(secured["decode"].target, WorkerAccess(TOKEN)) as client:
        assert (await client.load()).serving
    config = router_config(model_dir, secured["decode"].target, secured["prefill"].target,
                           WorkerAccess(TOKEN))
    out = await served_completion(config)
    assert out.choices[0].finish_reason == "length" and out.usage is not None
    assert out.usage.completion_tokens == 4


@in_module_loop
async def test_a_tls_worker_answers_clients_trusting_its_ca_and_not_plain_text(certs: Certs) -> None:
    """The gRPC server only (no engine: Load answers, saying it does not serve); completions over
    TLS are the mutual TLS test's."""
    server = WorkerServer(WorkerOptions(role="colocated", port=free_port(),
                                        tls=TLSFiles(certs.server_cert, certs.server_key)))
    await server.server.start()
    try:
        for target in (server.target, f"localhost:{server.port}"):  # both names of the certificate
            async with WorkerClient(target, WorkerAccess(tls=TLSFiles(ca=certs.ca))) as client:
                assert not (await client.load(timeout_s=10)).serving
        async with WorkerClient(server.target, WorkerAccess()) as plain:
            with pytest.raises(WorkerError, match="UNAVAILABLE"):
                await plain.load(timeout_s=5)
        # An address a `dns:` name resolved to is checked against that name, not the address.
        trusting = WorkerAccess(tls=TLSFiles(ca=certs.ca))
        async with WorkerClient(server.target, trusting, server_name="localhost") as named:
            assert not (await named.load(timeout_s=10)).serving
        async with WorkerClient(server.target, trusting, server_name="other.example") as misnamed:
            with pytest.raises(WorkerError, match="UNAVAILABLE"):
                await misnamed.load(timeout_s=5)
    finally:
        await server.server.stop(None)


@in_module_loop
async def test_a_router_with_the_client_certificate_serves_over_mutual_tls_and_one_without_fails(
        secured: dict[str, WorkerServer], model_dir: Path, certs: Certs) -> None:
    target = secured["mtls"].target
    with_cert = WorkerAccess(TOKEN, TLSFiles(certs.client_cert, certs.client_key, certs.ca))
    out = await served_completion(router_config(model_dir, target, access=with_cert))
    assert out.usage is not None and out.usage.completion_tokens == 4
    for access in (WorkerAccess(TOKEN, TLSFiles(ca=certs.ca)), WorkerAccess(TOKEN)):
        async with WorkerClient(target, access) as client:
            with pytest.raises(WorkerError, match="UNAVAILABLE"):
                await client.load(timeout_s=5)


def test_a_worker_without_credentials_refuses_a_non_loopback_host(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("PDSERVE_WORKER_TOKEN", raising=False)
    monkeypatch.delenv("PDSERVE_WORKER_TOKEN_FILE", raising=False)
    port = free_port()
    args = build_parser().parse_args(["worker", "--role", "colocated", "--host", "0.0.0.0", "--port",
                                      str(port), "--model", str(model_dir)])
    assert args.func(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refusing to listen on 0.0.0.0" in err and "--no-auth" in err
    assert port_free("0.0.0.0", port)
    with pytest.raises(ExposedWorkerError):
        WorkerServer(WorkerOptions(role="colocated", host="0.0.0.0", port=port))


@in_module_loop
async def test_no_auth_opens_a_non_loopback_host_and_loopback_is_open_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """Constructed only (bound, never started: nothing answers on the wildcard address)."""
    for host, no_auth in (("0.0.0.0", True), ("127.0.0.1", False)):
        caplog.clear()
        server = WorkerServer(WorkerOptions(role="colocated", host=host, port=free_port(), no_auth=no_auth))
        try:
            assert server.port > 0
            assert ("accepts calls from any local process" in caplog.text) == (not no_auth)
        finally:
            await server.server.stop(None)


@in_module_loop
async def test_admin_registers_only_targets_in_the_worker_networks(
        secured: dict[str, WorkerServer], model_dir: Path) -> None:
    """By default private networks only: loopback, link-local (the cloud metadata address) and
    public addresses, or names resolving there, are 400s naming `target`, and nothing is sent
    there; listed, loopback workers join."""
    real = secured["mtls"].target
    config = router_config(model_dir, secured["decode"].target, access=WorkerAccess(TOKEN))
    with ServedRouter(config) as served:
        admin = f"{served.url}/admin/workers"
        async with httpx.AsyncClient(timeout=30) as http:
            for target in ("169.254.169.254:80", "[fe80::1]:80", real, "localhost:" + real.rsplit(":", 1)[1],
                           "8.8.8.8:53", "[::1]:80"):
                reply = await http.post(admin, json={"role": "colocated", "target": target})
                assert reply.status_code == 400, (target, reply.text)
                error = reply.json()["error"]
                assert error["param"] == "target" and "worker networks" in error["message"], error
            assert [w["target"] for w in (await http.get(admin)).json()["workers"]] == \
                [secured["decode"].target]
    with pytest.raises(ValueError, match="worker_networks"):
        router_config(model_dir, real, worker_networks=("10.0.0.0/33",))


@in_module_loop
async def test_admin_registers_only_well_formed_reachable_targets(
        secured: dict[str, WorkerServer], model_dir: Path) -> None:
    config = router_config(model_dir, secured["decode"].target, access=WorkerAccess(TOKEN),
                           worker_networks=("127.0.0.0/8",))
    unreachable = f"127.0.0.1:{free_port()}"
    with ServedRouter(config) as served:
        admin = f"{served.url}/admin/workers"
        async with httpx.AsyncClient(timeout=30) as http:
            for target in ("127.0.0.1:99999", "127.0.0.1:0", "http://x:1", "a b:1", "127.0.0.1", "[::1",
                           "[zz]:1", "-bad-.example:80", "x" * 64 + ":1", unreachable):
                reply = await http.post(admin, json={"role": "colocated", "target": target})
                assert reply.status_code == 400, target
                assert reply.json()["error"]["param"] == "target", target
            assert "did not accept a TCP connection" in reply.json()["error"]["message"]
            real = secured["mtls"].target
            assert (await http.post(admin, json={"role": "colocated", "target": real})).status_code == 200
            assert real in [w["target"] for w in (await http.get(admin)).json()["workers"]]
            reply = await http.post(f"{admin}/drain", json={"role": "colocated", "target": real})
            assert reply.status_code == 200
            reply = await http.post(f"{admin}/remove", json={"role": "colocated", "target": real})
            assert reply.status_code == 200


@in_module_loop
async def test_api_docs_need_the_api_key_or_are_off(secured: dict[str, WorkerServer],
                                                    model_dir: Path) -> None:
    paths = ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")
    target = secured["decode"].target
    with ServedRouter(router_config(model_dir, target, api_keys=("k3y",))) as served:
        async with httpx.AsyncClient(base_url=served.url) as http:
            for path in paths:
                assert (await http.get(path)).status_code == 401, path
                ok = await http.get(path, headers={"authorization": "Bearer k3y"})
                assert ok.status_code == 200, path
    with ServedRouter(router_config(model_dir, target, disable_docs=True)) as served:
        async with httpx.AsyncClient(base_url=served.url) as http:
            for path in paths:
                assert (await http.get(path)).status_code == 404, path
