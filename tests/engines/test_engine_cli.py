"""`poolrelay serve --engine ...` flags: what is refused at start, and what a good command configures."""

from __future__ import annotations

import pytest

from poolrelay.cli import build_parser, config_from_args
from poolrelay.engine.config import parse_worker

BASE = ["serve", "--discovery", "127.0.0.1:1", "--routing-pool", "p", "--routing-pool-region", "r"]
WORKER = "url=http://127.0.0.1:8000,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558"


def config(argv):
    parser = build_parser()
    return config_from_args(parser, parser.parse_args(argv))


def refused(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        config(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_a_vllm_pool_is_configured_from_its_workers():
    cfg = config([*BASE, "--engine", "vllm", "--engine-block-size", "32", "--engine-worker", WORKER])
    assert cfg.engine.kind == "vllm" and cfg.engine.block_size == 32
    (w,) = cfg.engine.workers
    assert (w.worker_id, w.url, w.events, w.replay, w.bind) == (
        "w0",
        "http://127.0.0.1:8000",
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        False,
    )
    assert cfg.frontends == ("http://127.0.0.1:8000",)  # the workers' URLs unless told otherwise


def test_engine_block_size_must_be_a_multiple_of_the_mesh_block_size(capsys):
    err = refused(capsys, [*BASE, "--engine", "vllm", "--engine-block-size", "24", "--engine-worker", WORKER])
    assert "24" in err and "whole multiple" in err


@pytest.mark.parametrize(
    ("worker", "says"),
    [
        ("events=tcp://127.0.0.1:1", "url="),
        ("url=http://h:1", "exactly one of events"),
        ("url=http://h:1,events=tcp://h:1,events-bind=tcp://h:2", "exactly one of events"),
        ("url=ftp://h:1,events=tcp://h:1", "url must be an http"),
        ("url=http://h:1,events=udp://h:1", "ZMQ endpoint"),
        ("url=http://h:1,events=tcp://*:1", "wildcard"),
        ("url=http://h:1,events=tcp://h:1,colour=red", "unknown key"),
        ("url=http://h:1,events", "key=value"),
    ],
)
def test_a_bad_worker_is_refused_naming_the_problem(capsys, worker, says):
    err = refused(
        capsys, [*BASE, "--engine", "sglang", "--engine-block-size", "16", "--engine-worker", worker]
    )
    assert says in err and "--engine-worker" in err


def test_engine_flags_need_each_other(capsys):
    assert "--engine-worker" in refused(capsys, [*BASE, "--engine", "vllm", "--engine-block-size", "32"])
    assert "--engine-block-size" in refused(capsys, [*BASE, "--engine", "vllm", "--engine-worker", WORKER])
    assert "--pool is required" in refused(capsys, [*BASE, "--routing-pool-frontends", "http://h:1"])
    err = refused(
        capsys, [*BASE, "--pool", "h:1", "--routing-pool-frontends", "http://h:1", "--engine-worker", WORKER]
    )
    assert "need --engine vllm or sglang" in err


def test_worker_ids_are_unique_and_bind_is_explicit(capsys):
    w = parse_worker("url=https://pool.example.com/v1,events-bind=tcp://*:5557,id=dp1", 3)
    assert w.bind and w.events == "tcp://*:5557" and w.worker_id == "dp1"
    twice = ["--engine-worker", WORKER + ",id=a"] * 2
    err = refused(capsys, [*BASE, "--engine", "vllm", "--engine-block-size", "32", *twice])
    assert "unique" in err
