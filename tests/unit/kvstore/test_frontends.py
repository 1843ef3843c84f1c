"""kvstore/frontends.py: which front-end a call goes to, moving on when one is unreachable, and
`dns:` names resolved to every address (again after `resolve_s`), with a resolver the test
controls; the redis-cluster URL parser; the slot layout's hash tags."""

from __future__ import annotations

import pytest

from kvstore.backends.cluster_keys import KeyLayout, hash_tagged
from kvstore.backends.redis_cluster import parse_cluster_url
from kvstore.frontends import Frontends, Target, is_multi
from kvstore.link import KVStoreUnavailableError


class Front:
    def __init__(self, target: Target) -> None:
        self.target = target
        self.down = False
        self.closed = False
        self.calls = 0


def make(spec: str, resolver: object = None, resolve_s: float = 5.0) -> Frontends[Front]:
    def close(f: Front) -> None:
        f.closed = True

    kwargs = {} if resolver is None else {"resolver": resolver}
    return Frontends(spec, Front, close, lambda loc: loc if "://" in loc else "grpc://" + loc,
                     resolve_s=resolve_s, **kwargs)  # type: ignore[arg-type]


def call(front: Front) -> str:
    front.calls += 1
    if front.down:
        raise KVStoreUnavailableError(f"{front.target.location} is down")
    return front.target.location


def test_one_location_is_one_front_end_and_a_list_is_several() -> None:
    assert not is_multi("grpc://a:1") and is_multi("a:1,b:2") and is_multi("dns:store:50071")
    fronts = make("a:1, grpc://b:2 ,c:3")
    assert [f.target.location for f in fronts.all()] == ["grpc://a:1", "grpc://b:2", "grpc://c:3"]
    with pytest.raises(ValueError):
        make(" , ")


def test_a_key_always_goes_to_the_same_front_end_and_keys_spread_over_all() -> None:
    fronts = make("a:1,b:2,c:3")
    is_down = lambda f: f.down  # noqa: E731
    assert len({fronts.run("some-key", is_down, call) for _ in range(5)}) == 1
    assert len({fronts.run(f"key-{i}", is_down, call) for i in range(30)}) == 3
    assert len({fronts.run(None, is_down, call) for _ in range(3)}) == 3  # in turn


def test_a_call_moves_on_past_an_unreachable_front_end_and_fails_only_when_all_are() -> None:
    fronts = make("a:1,b:2,c:3")
    a, b, c = fronts.all()
    a.down = b.down = True
    assert {fronts.run(f"key-{i}", lambda f: False, call) for i in range(10)} == {"grpc://c:3"}
    assert fronts.order("x", lambda f: f.down)[0] is c  # open breakers last
    c.down = True
    with pytest.raises(KVStoreUnavailableError):
        fronts.run("x", lambda f: False, call)


def test_a_dns_name_is_every_address_it_resolves_to_and_is_resolved_again() -> None:
    answers = {"store": ["10.0.0.1", "10.0.0.2"]}
    fronts = make("dns:store:50071", resolver=lambda host, port: answers[host], resolve_s=0.0)
    first = fronts.all()
    assert [f.target for f in first] == [Target("grpc://10.0.0.1:50071", "store"),
                                         Target("grpc://10.0.0.2:50071", "store")]
    answers["store"] = ["10.0.0.2", "fd00::3"]
    second = fronts.all()
    assert [f.target.location for f in second] == ["grpc://10.0.0.2:50071", "grpc://[fd00::3]:50071"]
    assert first[0].closed and second[0] is first[1]  # kept, not rebuilt

    def failing(host: str, port: int) -> list[str]:
        raise OSError("no DNS")

    fronts._resolver = failing
    assert [f.target.location for f in fronts.all()] == [f.target.location for f in second]
    answers["store"] = []
    empty = make("dns:store:1", resolver=lambda host, port: answers[host], resolve_s=0.0)
    with pytest.raises(KVStoreUnavailableError, match="no address"):
        empty.all()
    with pytest.raises(ValueError, match="dns:<name>:<port>"):
        make("dns:store")


def test_redis_cluster_urls_name_startup_nodes_and_credentials() -> None:
    nodes, options = parse_cluster_url("redis://u:p%40ss@r1:7000,r2:7001,redis://r3")
    assert [(n.host, n.port) for n in nodes] == [("r1", 7000), ("r2", 7001), ("r3", 6379)]
    assert options == {"username": "u", "password": "p@ss"}
    assert parse_cluster_url("rediss://r1:7000/0")[1] == {"ssl": True}
    with pytest.raises(ValueError):
        parse_cluster_url("http://r1:1")


def test_the_slot_layout_tags_every_key_of_an_object_alike() -> None:
    keys = KeyLayout("slot").keys("m@1@0@ab@half")
    assert keys.meta == "{m@1@0@ab@half}metadata" and keys.data == "{m@1@0@ab@half}kv_bytes"
    odd = hash_tagged("}x")
    assert odd.startswith("{") and odd.endswith("}}x") and "}" not in odd[1:-3]
    assert KeyLayout("lmcache").keys("K").meta == "Kmetadata"
    with pytest.raises(ValueError):
        KeyLayout("other")
