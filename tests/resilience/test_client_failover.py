"""The fail-over client against in-process fake frontends: a frontend lost mid-stream is continued on
the next with prompt + tokens so far and the remaining budget; a frontend's own answer is final."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from globalrouter import client as client_module
from globalrouter.client import FailoverClient, FailoverError, FailoverPolicy, frontend_lost, router_list
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.errors import Reason, grpc_status_for
from meshlaunch import free_port
from mocker.tokens import continue_sequence

pytestmark = pytest.mark.timeout(30)
PROMPT = list(range(40))


class FakeFrontend(router_pb2_grpc.RouterServiceServicer):
    """Streams the deterministic continuation one token per message; `die_after` tokens into a
    stream it drops the call as a dying process would (UNAVAILABLE, no reason); `answer` makes it
    refuse with a reasoned status instead."""

    def __init__(
        self,
        die_after: int | None = None,
        answer: tuple[grpc.StatusCode, Reason] | None = None,
        crash: bool = False,
    ):
        self.die_after = die_after
        self.answer = answer
        self.crash = crash
        self.requests: list[router_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        if self.crash:  # a poisonous request: the handler raises (grpc answers UNKNOWN, no reason)
            raise RuntimeError("poisonous request")
        if self.answer is not None:
            context.abort_with_status(grpc_status_for(self.answer[0], self.answer[1], "a considered no"))
        prompt = list(request.prompt.token_ids.ids)
        out = continue_sequence(prompt, request.max_tokens)
        for i, token in enumerate(out):
            if self.die_after is not None and i == self.die_after:
                self.die_after = None  # dies once
                context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            yield router_pb2.GenerateResponse(
                tokens=router_pb2.TokenChunk(token_ids=[token], offset=i, pool_id="pool-x")
            )
        yield router_pb2.GenerateResponse(
            summary=router_pb2.GenerateSummary(
                finish_reason=router_pb2.FINISH_REASON_LENGTH,
                pools=["pool-x"],
                tokens_generated=len(out),
                request_id=request.request_id or "r",
            )
        )


@contextlib.contextmanager
def frontends(*servicers: FakeFrontend) -> Iterator[list[str]]:
    servers, addresses = [], []
    for servicer in servicers:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    try:
        yield addresses
    finally:
        for server in servers:
            server.stop(0)


def test_a_frontend_lost_mid_stream_is_continued_on_the_next_without_loss_or_repeat():
    a, b = FakeFrontend(die_after=7), FakeFrontend()
    with frontends(a, b) as addresses, FailoverClient(addresses) as client:
        batches: list[list[int]] = []
        result = client.generate("m", PROMPT, 30, on_tokens=batches.append)
        assert client.current == addresses[1], "the client stays on the frontend that worked"
    assert result.tokens == continue_sequence(PROMPT, 30)
    assert [t for batch in batches for t in batch] == result.tokens
    assert (result.failovers, result.frontends) == (1, addresses)
    assert result.finish_reason == "length" and len(result.errors) == 1 and "UNAVAILABLE" in result.errors[0]
    resumed = b.requests[0]
    assert list(resumed.prompt.token_ids.ids) == PROMPT + result.tokens[:7], "prompt + tokens so far"
    assert resumed.max_tokens == 23, "the remaining budget"


def test_an_unreachable_first_frontend_is_skipped():
    with (
        frontends(FakeFrontend()) as addresses,
        FailoverClient([f"127.0.0.1:{free_port()}", *addresses]) as c,
    ):
        result = c.generate("m", PROMPT, 5)
    assert result.tokens == continue_sequence(PROMPT, 5) and result.failovers == 1


def test_a_frontends_reasoned_answer_is_final():
    a, b = FakeFrontend(answer=(grpc.StatusCode.UNAVAILABLE, Reason.NO_ELIGIBLE_POOL)), FakeFrontend()
    with frontends(a, b) as addresses, FailoverClient(addresses) as client:
        with pytest.raises(FailoverError) as info:
            client.generate("m", PROMPT, 5)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and info.value.reason == "NO_ELIGIBLE_POOL"
    assert b.requests == [], "no fail-over on a considered answer"


def test_every_frontend_lost_ends_with_a_clear_error_and_the_tokens_received():
    with FailoverClient([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]) as client:
        with pytest.raises(FailoverError) as info:
            client.generate("m", PROMPT, 5)
    err = info.value
    assert err.code is grpc.StatusCode.UNAVAILABLE and "every global frontend was lost" in err.message
    assert err.tokens == []


def test_frontend_lost_classification():
    lost = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x"
    )
    final = grpc.aio.AioRpcError(
        grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x"
    )
    assert frontend_lost(lost) and not frontend_lost(final)


def test_frontend_lost_by_code_origin_not_text():
    def error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")

    # A lost peer or connection, or an HTTP/2 stream reset: transport failures.
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL):
        assert frontend_lost(error(code)), code
    # The frontend's application raised: it ran the request, another would fail the same way.
    assert not frontend_lost(error(grpc.StatusCode.UNKNOWN))


def test_a_poisonous_request_is_not_retried_across_the_fleet():
    fleet = [FakeFrontend(crash=True) for _ in range(4)]
    with frontends(*fleet) as addresses, FailoverClient(addresses) as client:
        with pytest.raises(FailoverError) as info:
            client.generate("m", PROMPT, 5)
    assert info.value.code is grpc.StatusCode.UNKNOWN
    assert [len(f.requests) for f in fleet] == [1, 0, 0, 0], "one frontend tried, no fail-over"


def test_the_failover_budget_is_capped_whatever_the_fleet_size(monkeypatch):
    monkeypatch.setattr(client_module, "failover_wait", lambda barren: 0.0)
    dead = [f"127.0.0.1:{free_port()}" for _ in range(50)]
    with FailoverClient(dead) as client:
        with pytest.raises(FailoverError) as info:
            client.generate("m", PROMPT, 5, timeout=20)
    assert "4 fail-overs of 4 allowed" in info.value.message
    assert client.current == dead[4], "4 fail-overs (the default cap), not 2 x 50"
    with FailoverClient(dead, policy=FailoverPolicy(max_failovers=1)) as client:
        with pytest.raises(FailoverError):
            client.generate("m", PROMPT, 5, timeout=20)
    assert client.current == dead[1], "the configured cap"


def test_small_meshes_keep_their_budget():
    assert [FailoverPolicy().limit(n) for n in (1, 2, 3, 50)] == [2, 4, 4, 4]
    assert FailoverPolicy(per_frontend=1, max_failovers=10).limit(50) == 10
    for bad in ({"per_frontend": 0}, {"max_failovers": -1}):
        with pytest.raises(ValueError, match="FailoverPolicy"):
            FailoverPolicy(**bad)


def test_router_list_flag():
    assert router_list("a:1,b:2") == ["a:1", "b:2"]
    for bad in ("", "a:1,a:1", "nohost"):
        with pytest.raises(argparse.ArgumentTypeError):
            router_list(bad)


def test_generate_cli_takes_several_routers(capsys):
    from globalrouter.cli import main

    a, b = FakeFrontend(die_after=2), FakeFrontend()
    with frontends(a, b) as addresses:
        code = main(
            [
                "generate",
                "--router",
                ",".join(addresses),
                "--model",
                "m",
                "--tokens",
                "1,2,3",
                "--max-tokens",
                "6",
                "--json",
            ]
        )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == continue_sequence([1, 2, 3], 6) and out["failovers"] == 1


def test_generate_cli_max_failovers(capsys):
    from globalrouter.cli import main

    dead = ",".join(f"127.0.0.1:{free_port()}" for _ in range(3))
    argv = ["generate", "--router", dead, "--model", "m", "--tokens", "1,2", "--max-tokens", "2"]
    assert main([*argv, "--max-failovers", "1", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["error"] == "UNAVAILABLE" and "1 fail-overs of 1 allowed" in out["message"]
    with pytest.raises(SystemExit):
        main([*argv, "--max-failovers", "-1"])
    assert "--max-failovers: must be at least 0" in capsys.readouterr().err
