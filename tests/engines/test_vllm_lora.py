"""A real vLLM serving a tiny LoRA adapter made at test time, behind the mesh.

One CPU vLLM (the tiny model of make_model.py, `--enable-lora --lora-modules sql-lora=DIR` with an
adapter written by make_lora.py) and its relay; a mocker pool of the same model without the
adapter; discovery; one global frontend. The relay reads the adapter from vLLM's /v1/models and
reports it; a request naming it goes only to vLLM, which answers with the adapter applied; vLLM's
KV events for it (lora_name, extra keys) reach the frontend's index under the adapter's own block
hashes, so the adapter's next request finds its prefix there and the base model's does not.

Run by `make test-engines` (ENGINES_PYTHON, GR_TEST_ENGINES=1); skipped otherwise.
"""

from __future__ import annotations

import grpc
import pytest

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshlaunch.vllm_engine import MODEL, Engine
from tests.engines.test_vllm_e2e import _engines_or_skip
from tests.engines.vllm_support import make_engine_files, start_vllm_relay, wait_vllm
from tests.router.mesh import Mesh
from tests.support import ProcessGroup, free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
ADAPTER = "sql-lora"
PROMPT = list(range(300, 400))  # 100 tokens: 3 engine blocks of 32, 6 mesh blocks of 16


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    python = _engines_or_skip()
    tmp = tmp_path_factory.mktemp("lora")
    model_dir = make_engine_files(python, tmp / "model")
    lora_dir = make_engine_files(python, tmp / "lora", "make_lora.py")
    group = ProcessGroup(tmp)
    try:
        engine = Engine("pool-vllm", free_port(), free_port(), free_port())
        lora = [
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--max-loras",
            "1",
            "--lora-modules",
            f"{ADAPTER}={lora_dir}",
        ]
        engine.proc = group.start(
            "vllm", [*engine.args(python, model_dir), *lora], env={"VLLM_CPU_KVCACHE_SPACE": "1"}
        )
        mesh = Mesh(group)
        mesh.start_discovery(None, "--heartbeat-interval", "2", "--lease-duration", "10")
        router = mesh.start_router()
        mesh.start_pool("pool-mock", "local", "--workers", "1", "--speedup", "10", model=MODEL)
        wait_vllm(engine)
        start_vllm_relay(group, engine, "pool-vllm", mesh.discovery)
        mesh.wait_routable(router, ["pool-vllm", "pool-mock"], timeout=120)
        yield engine, router
    except BaseException:
        print(group.dump_logs(6000))
        raise
    finally:
        group.stop_all()


def stub_call(router, fn):
    with grpc.insecure_channel(router.address) as ch:
        return fn(router_pb2_grpc.RouterServiceStub(ch))


def route(router, model, tokens):
    req = router_pb2.RouteRequest(
        model=model, prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens))
    )
    return stub_call(router, lambda s: s.Route(req, timeout=10))


def generate(router, model, tokens, max_tokens):
    req = router_pb2.GenerateRequest(
        model=model,
        prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens)),
        max_tokens=max_tokens,
    )
    out: list[int] = []
    summary = None
    for msg in stub_call(router, lambda s: list(s.Generate(req, timeout=300))):
        if msg.WhichOneof("payload") == "tokens":
            out.extend(msg.tokens.token_ids)
        else:
            summary = msg.summary
    return out, summary


def test_a_request_naming_the_adapter_is_served_by_vllm_under_it_with_prefix_affinity(lm):
    engine, router = lm
    # The relay read the adapter from vLLM's /v1/models and reported it.
    wait_until(
        lambda: [c.pool_id for c in route(router, ADAPTER, PROMPT).candidates] == ["pool-vllm"],
        60,
        message="the frontend sees pool-vllm serving the adapter",
    )
    r = route(router, ADAPTER, PROMPT)
    assert [(f.pool_id, f.reason) for f in r.filtered] == [
        ("pool-mock", router_pb2.FILTER_REASON_ADAPTER_NOT_SERVED)
    ]
    # Through the mesh, under the adapter: vLLM's own greedy answer for the adapter, not the base's.
    tokens, summary = generate(router, ADAPTER, PROMPT, 4)
    assert list(summary.pools) == ["pool-vllm"]
    assert tokens == complete(engine, ADAPTER, PROMPT, 4)
    assert tokens != complete(engine, MODEL, PROMPT, 4)
    # vLLM's events for the adapter's blocks reach the index under the adapter's hashes: its next
    # request finds the 6-block prefix at pool-vllm, the base model's request (same tokens) does not
    # find the adapter's blocks (the base blocks its direct completion above cached are its own).
    wait_until(
        lambda: route(router, ADAPTER, [*PROMPT[:96], 7, 8]).candidates[0].cached_blocks == 6,
        60,
        message="the adapter's prefix indexed at pool-vllm",
    )
    other = list(range(500, 600))
    generate(router, ADAPTER, other, 2)
    wait_until(
        lambda: route(router, ADAPTER, other).candidates[0].cached_blocks == 6,
        60,
        message="a second adapter prefix indexed",
    )
    base = {c.pool_id: c.cached_blocks for c in route(router, MODEL, other).candidates}
    assert base.get("pool-vllm") == 0


def complete(engine: Engine, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """vLLM's greedy completion asked directly, under `model` (the base model or an adapter)."""
    import json
    import urllib.request

    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
    ).encode()
    req = urllib.request.Request(engine.url + "/v1/completions", body, {"Content-Type": "application/json"})
    choice = json.loads(urllib.request.urlopen(req, timeout=300).read())["choices"][0]
    return list(choice["token_ids"])
