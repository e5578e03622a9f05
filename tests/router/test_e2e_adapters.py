"""End to end, real processes: LoRA adapters and model aliases.

Discovery; two mocker pools of the demo model, one serving the adapter `sql-lora` and one not; a
pool of a second model; a global frontend with an aliases file (re-read on SIGHUP). A request
naming the adapter goes only to the pool serving it and gets prefix affinity there (under the
adapter's own block hashes, which the base model never matches); an alias split 0 / 1 goes to the
model with the weight, and a reload moves it.
"""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request

import grpc
import pytest

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshlaunch import MODEL, Mesh, process_group, wait_until
from meshlaunch.process import free_port
from mocker.tokens import continue_sequence

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
V2 = "demo-model-v2"
ADAPTER = "sql-lora"
PREFIX = [(11 * i + 5) % 30_000 for i in range(512)]  # 32 blocks of 16


def aliases(v1: float, v2: float) -> str:
    return f'[aliases]\nchat = {{ "{MODEL}" = {v1}, "{V2}" = {v2} }}\nsql = "{MODEL}:{ADAPTER}"\n'


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    file = tmp / "aliases.toml"
    file.write_text(aliases(0, 1))
    with process_group(tmp) as group:
        m = Mesh(group)
        m.start_discovery()
        m.start_pool("pool-lora", "eu", "--workers", "1", "--speedup", "10", "--adapter", ADAPTER)
        m.start_pool("pool-plain", "eu", "--workers", "1", "--speedup", "10")
        m.start_pool("pool-v2", "eu", "--workers", "1", "--speedup", "10", model=V2)
        http_port = free_port()
        m.start_router("--aliases", str(file), "--http-listen", f"127.0.0.1:{http_port}")
        m.wait_routable(m.routers[0], m.pools)
        m.aliases_file = file  # type: ignore[attr-defined]
        m.http_port = http_port  # type: ignore[attr-defined]
        yield m


def prompt(tokens):
    return router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens))


def generate(address, model, tokens, request_id="", max_tokens=4):
    """(tokens, summary) of one Generate."""
    out: list[int] = []
    summary = None
    with grpc.insecure_channel(address) as ch:
        req = router_pb2.GenerateRequest(
            model=model, prompt=prompt(tokens), max_tokens=max_tokens, request_id=request_id
        )
        for msg in router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=30):
            if msg.WhichOneof("payload") == "tokens":
                out.extend(msg.tokens.token_ids)
            else:
                summary = msg.summary
    return out, summary


def route(address, model, tokens):
    with grpc.insecure_channel(address) as ch:
        return router_pb2_grpc.RouterServiceStub(ch).Route(
            router_pb2.RouteRequest(model=model, prompt=prompt(tokens)), timeout=5
        )


def test_an_adapter_request_goes_only_to_the_pool_serving_it_with_prefix_affinity_there(mesh):
    router = mesh.routers[0].address
    # The relay reports the adapter in its readiness: until the router has it, nothing serves it.
    wait_until(
        lambda: [c.pool_id for c in route(router, ADAPTER, PREFIX).candidates] == ["pool-lora"],
        15,
        message="the router sees pool-lora serving the adapter",
    )
    r = route(router, f"{MODEL}:{ADAPTER}", PREFIX)
    reasons = {f.pool_id: f.reason for f in r.filtered}
    assert reasons == {
        "pool-plain": router_pb2.FILTER_REASON_ADAPTER_NOT_SERVED,
        "pool-v2": router_pb2.FILTER_REASON_OTHER_MODEL,
    }
    detail = next(f.detail for f in r.filtered if f.pool_id == "pool-plain")
    assert f"adapter {ADAPTER!r}" in detail
    for i in range(3):  # by the adapter's name, as model:adapter, and by an alias
        tokens, summary = generate(router, (ADAPTER, f"{MODEL}:{ADAPTER}", "sql")[i], [*PREFIX, i])
        assert list(summary.pools) == ["pool-lora"] and tokens == continue_sequence([*PREFIX, i], 4)
    # The prefix is cached under the adapter: the adapter's requests find it, the base model's don't.
    wait_until(
        lambda: route(router, ADAPTER, [*PREFIX, 9]).candidates[0].cached_blocks == 32,
        15,
        message="the adapter's prefix indexed at pool-lora",
    )
    base = {c.pool_id: c.cached_blocks for c in route(router, MODEL, [*PREFIX, 9]).candidates}
    assert base == {"pool-lora": 0, "pool-plain": 0}
    # The pool admitted it with the prefix cached (the mocker hashes under the adapter too).
    _, summary = generate(router, ADAPTER, [*PREFIX, 7])
    assert summary.cached_blocks == 32
    # An adapter no pool serves: NOT_FOUND, as for a model no pool serves.
    with pytest.raises(grpc.RpcError) as e:
        generate(router, f"{MODEL}:no-such-lora", PREFIX)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_alias_split_0_1_goes_to_the_weighted_model_and_a_sighup_moves_it(mesh):
    router = mesh.routers[0]
    pools = {generate(router.address, "chat", [1, 2, 3], request_id=f"r-{i}")[1].pools[0] for i in range(6)}
    assert pools == {"pool-v2"}
    mesh.aliases_file.write_text(aliases(1, 0))
    router.proc.signal(signal.SIGHUP)
    wait_until(
        lambda: generate(router.address, "chat", [1, 2, 3], request_id="r-x")[1].pools[0] != "pool-v2",
        15,
        message="the reloaded aliases in force",
    )
    pools = {generate(router.address, "chat", [4, 5], request_id=f"s-{i}")[1].pools[0] for i in range(6)}
    assert pools <= {"pool-lora", "pool-plain"}
    # A bad file is refused on SIGHUP: the aliases in force stay.
    mesh.aliases_file.write_text('[aliases]\nchat = { "x" = -1 }\n')
    router.proc.signal(signal.SIGHUP)
    wait_until(lambda: "aliases (refused" in router.proc.output(), 10, message="the refusal logged")
    assert generate(router.address, "chat", [6], request_id="t")[1].pools[0] in {"pool-lora", "pool-plain"}
    mesh.aliases_file.write_text(aliases(0, 1))
    router.proc.signal(signal.SIGHUP)


def test_v1_models_lists_models_adapters_and_aliases(mesh):
    url = f"http://127.0.0.1:{mesh.http_port}/v1/models"
    wait_until(
        lambda: any(
            m["id"] == ADAPTER for m in json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]
        ),
        15,
        message="the adapter listed",
    )
    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert body["object"] == "list"
    got = {m["id"]: m for m in body["data"]}
    assert got[MODEL]["object"] == "model" and got[MODEL]["parent"] is None
    assert got[ADAPTER]["parent"] == MODEL and got[ADAPTER]["root"] == MODEL
    assert got[V2]["parent"] is None
    assert got["chat"]["parent"] is None and got["chat"]["root"] is None  # a split: no one target
    assert got["sql"]["parent"] is None and got["sql"]["root"] == f"{MODEL}:{ADAPTER}"
    assert set(got) == {MODEL, V2, ADAPTER, "chat", "sql"}


def complete_http(mesh, model: str, request_id: str, prompt: list[int]):
    """POST /v1/completions (not streamed): (status, body, x-pools)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{mesh.http_port}/v1/completions",
        body,
        {"content-type": "application/json", "x-request-id": request_id},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as reply:
            return reply.status, json.loads(reply.read()), reply.headers.get("x-pools")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), None


def test_the_http_front_resolves_adapters_and_aliases_the_same_way(mesh):
    wait_until(
        lambda: complete_http(mesh, ADAPTER, "h-0", PREFIX[:40])[2] == "pool-lora",
        15,
        message="the HTTP front routes the adapter",
    )
    for i, name in enumerate((ADAPTER, f"{MODEL}:{ADAPTER}", "sql")):
        status, body, pools = complete_http(mesh, name, f"h-{i}", PREFIX[:40])
        assert (status, pools) == (200, "pool-lora") and body["model"] == name  # echoes the name asked
    assert complete_http(mesh, "chat", "h-9", [1, 2, 3])[2] in {"pool-v2", "pool-lora", "pool-plain"}
    status, body, _ = complete_http(mesh, f"{MODEL}:no-such-lora", "h-10", [1, 2])
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_list_pools_and_the_status_page_name_each_pools_adapters(mesh):
    def views():
        with grpc.insecure_channel(mesh.routers[0].address) as ch:
            page = router_pb2_grpc.RouterServiceStub(ch).ListPools(router_pb2.ListPoolsRequest(), timeout=5)
        return {p.pool_id: list(p.adapters) for p in page.pools}

    wait_until(lambda: views().get("pool-lora") == [ADAPTER], 15, message="ListPools names the adapter")
    assert views() == {"pool-lora": [ADAPTER], "pool-plain": [], "pool-v2": []}
    url = f"http://127.0.0.1:{mesh.http_port}/status.json"
    status = json.loads(urllib.request.urlopen(url, timeout=5).read())
    shown = {p["pool_id"]: p["adapters"] for r in status["regions"] for p in r["pools"]}
    assert shown == {"pool-lora": [ADAPTER], "pool-plain": [], "pool-v2": []}
