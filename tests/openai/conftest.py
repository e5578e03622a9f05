"""In-process fixtures: a global frontend with its HTTP front, real mocker pools, a locally trained tokenizer."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import openai
import pytest

from globalrouter.config import RouterConfig
from globalrouter.http_api.config import HttpConfig
from globalrouter.server import Router, create_server
from globalrouter.tokenizer import HfTokenizer
from globalrouter.tokenizer_train import train_tokenizer
from meshkit.clock import SystemClock
from mocker.config import Faults, PoolConfig
from mocker.pool import Pool
from mocker.server import build_server
from tests.router.fakes import pool_msg

MODEL = "m"
BYTE_MODEL = "b"
VOCAB = 400


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained here and now (nothing downloads)."""
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size=VOCAB)


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_dir) -> HfTokenizer:
    return HfTokenizer.load(tokenizer_dir)


@dataclass
class Front:
    """A running global frontend (gRPC + HTTP) routing to in-process mocker pools."""

    router: Router
    pools: dict[str, Pool]
    servers: list = field(default_factory=list)

    @property
    def base_url(self) -> str:
        assert self.router.http is not None
        return f"http://127.0.0.1:{self.router.http.port}"

    def client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, **kw)

    async def add_pool(self, pool_id: str, model: str = MODEL, vocab_size: int = VOCAB, **config) -> Pool:
        pool = Pool(
            PoolConfig(
                pool_id=pool_id,
                models=(model,),
                vocab_size=vocab_size,
                speedup=config.pop("speedup", 50.0),
                **config,
            ),
            SystemClock(),
            Faults(),
        )
        handle = build_server("127.0.0.1:0", pool, exit_process=lambda code: None)
        await handle.server.start()
        self.servers.append(handle.server)
        self.pools[pool_id] = pool
        self.router.core.table.apply_listed(pool_msg(pool_id, f"http://127.0.0.1:{handle.port}", model=model))
        return pool


@contextlib.asynccontextmanager
async def open_front(tokenizer_dir, **overrides):
    """A frontend with pools p1, p2 (model m, the trained tokenizer) and pb (model b, bytes, ASCII
    ids); `overrides`: RouterConfig fields (a policy file, late binding)."""
    config = RouterConfig(
        listen="127.0.0.1:0",
        migration_limit=2,
        admission_tries=3,
        grace=0.5,
        tokenizers=((MODEL, str(tokenizer_dir)),),
        http=HttpConfig(
            listen="127.0.0.1:0",
            max_body_bytes=64 * 1024,
            write_timeout=1.0,
            body_timeout=2.0,
        ),
        **overrides,
    )
    router = create_server(config)
    await router.handle.server.start()
    router.start_background()
    f = Front(router, {})
    try:
        await f.add_pool("p1")
        await f.add_pool("p2")
        await f.add_pool("pb", model=BYTE_MODEL, vocab_size=128)
        yield f
    finally:
        await router.leave()
        await router.close()
        await router.handle.server.stop(0)
        for server in f.servers:
            await server.stop(0)


@pytest.fixture
async def front(tokenizer_dir):
    """A frontend with pools p1, p2 (model m, the trained tokenizer) and pb (model b, bytes, ASCII ids)."""
    async with open_front(tokenizer_dir) as f:
        yield f
