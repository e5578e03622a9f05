"""End to end, real processes: the global frontend serving a client's stream is killed with -9; the
client continues on the other frontend and gets every token exactly once."""

from __future__ import annotations

import pytest

from globalrouter.client import FailoverClient
from meshlaunch import MODEL, Mesh
from mocker.tokens import continue_sequence

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
PROMPT = [(13 * i + 7) % 30_000 for i in range(80)]


def test_kill_9_of_the_clients_frontend_mid_stream_loses_and_repeats_nothing(procs):
    mesh = Mesh(procs)
    mesh.start_discovery()
    mesh.start_pool("pool-a", "eu", "--speedup", "1")  # 50 tokens/s: the stream lasts seconds
    routers = [mesh.start_router(), mesh.start_router()]
    for router in routers:
        mesh.wait_routable(router, ["pool-a"])
    by_address = {r.address: r for r in routers}
    with FailoverClient([r.address for r in routers]) as client:
        first = client.current
        seen: list[int] = []

        def on_tokens(ids: list[int]) -> None:
            seen.extend(ids)
            if len(seen) >= 10 and by_address[first].proc.alive():
                by_address[first].proc.kill9()  # the client's frontend crashes mid-stream

        result = client.generate(MODEL, PROMPT, 100, timeout=60, on_tokens=on_tokens)
    assert not by_address[first].proc.alive()
    assert result.tokens == seen == continue_sequence(PROMPT, 100), "nothing lost, nothing repeated"
    assert result.failovers == 1 and result.frontends == [first, next(a for a in by_address if a != first)]
    assert result.finish_reason == "length"
