"""Both fronts of a frontend run requests through one RequestPath, with the frontend's own
configuration (migration limit, admission tries, stall policy) and one prompt encoder."""

from __future__ import annotations

from globalrouter.config import RouterConfig
from globalrouter.http_api.config import HttpConfig
from globalrouter.server import create_server
from globalrouter.stall import StallPolicy


async def test_the_http_front_runs_requests_under_the_frontends_configuration():
    stall = StallPolicy(stall_timeout=1.5, first_token_timeout=2.5)
    router = create_server(
        RouterConfig(
            listen="127.0.0.1:0",
            migration_limit=1,
            admission_tries=2,
            stall=stall,
            tokenizer_threads=3,
            tokenizer_queue=5,
            http=HttpConfig(listen="127.0.0.1:0"),
        )
    )
    try:
        assert router.http is not None
        front = router.http.front
        path = front.path
        assert (path.stall, path.migration_limit, path.admission_tries) == (stall, 1, 2)
        assert path.links is router.links and path.core is router.core
        assert (front.encoder.threads, front.encoder.queue) == (3, 5)
    finally:
        await router.close()  # the bound HTTP socket, the links
        await router.handle.server.stop(0)
