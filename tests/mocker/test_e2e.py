"""A real `mocker serve` process: serving, SIGTERM drain and exit, fault injection, bad flags."""

from __future__ import annotations

import signal
import subprocess
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from globalrouter.v1 import pool_frontend_pb2 as pf
from globalrouter.v1 import pool_frontend_pb2_grpc as pf_grpc
from meshlaunch import Proc, command, free_port, wait_healthy, wait_until
from mocker.tokens import continue_sequence
from mocker.v1 import admin_pb2 as adm
from mocker.v1 import admin_pb2_grpc as adm_grpc
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import pool_events_pb2_grpc as pe_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
PROMPT = list(range(64))


def start_mocker(procs, *extra: str) -> tuple[str, Proc]:
    address = f"127.0.0.1:{free_port()}"
    proc = procs.start(
        "mocker",
        [command("mocker"), "serve", "--listen", address, "--pool-id", "e2e", "--model", "m", *extra],
    )
    wait_healthy(address, proc=proc)
    return address, proc


def generate(channel: grpc.Channel, max_tokens: int, request_id: str = "r"):
    return pf_grpc.PoolFrontendServiceStub(channel).Generate(
        pf.PoolFrontendServiceGenerateRequest(
            request_id=request_id, model="m", token_ids=PROMPT, max_tokens=max_tokens
        ),
        timeout=30,
    )


class Reader(threading.Thread):
    """Reads a streaming call in the background: tokens so far, and how it ended."""

    def __init__(self, call) -> None:
        super().__init__(daemon=True)
        self.call = call
        self.tokens: list[int] = []
        self.admitted = threading.Event()
        self.error: grpc.RpcError | None = None
        self.finished = False
        self.start()

    def run(self) -> None:
        try:
            for msg in self.call:
                if msg.HasField("admission"):
                    self.admitted.set()
                self.tokens.extend(msg.tokens.token_ids)
            self.finished = True
        except grpc.RpcError as exc:
            self.error = exc


def health(channel: grpc.Channel) -> int:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return -1


def test_serves_generate_events_and_admin_then_sigterm_exits_0(procs):
    address, proc = start_mocker(procs, "--speedup", "100")
    with grpc.insecure_channel(address) as channel:
        messages = list(generate(channel, 20))
        assert messages[0].HasField("admission") and messages[-1].HasField("finish")
        tokens = [t for m in messages for t in m.tokens.token_ids]
        assert tokens == continue_sequence(PROMPT, 20)
        snapshots = pe_grpc.PoolEventsServiceStub(channel).WatchKvEvents(
            pe.WatchKvEventsRequest(), timeout=10
        )
        first = next(snapshots)
        snapshots.cancel()
        blocks = adm_grpc.MockerAdminServiceStub(channel).GetWorkerBlocks(adm.GetWorkerBlocksRequest())
        assert list(first.snapshot.block_hashes) == list(blocks.workers[0].block_hashes)
        assert len(first.snapshot.block_hashes) == (64 + 20) // 16  # prompt and output blocks
    assert proc.terminate(timeout=15) == 0


def test_sigterm_drains_hands_back_running_work_and_exits_0(procs):
    address, proc = start_mocker(procs, "--drain-timeout", "1.5")
    with grpc.insecure_channel(address) as channel:
        reader = Reader(generate(channel, 100_000))  # 50 tok/s: far longer than the drain
        assert reader.admitted.wait(10)
        proc.signal(signal.SIGTERM)
        wait_until(
            lambda: health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING, 5, message="NOT_SERVING"
        )
        with pytest.raises(grpc.RpcError) as e:
            list(generate(channel, 1, request_id="late"))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        reader.join(20)
        assert reader.error is not None and reader.error.code() == grpc.StatusCode.UNAVAILABLE
        assert reader.error.details() == "drain deadline: handed back"
        assert reader.tokens == continue_sequence(PROMPT, len(reader.tokens))
    assert proc.popen.wait(timeout=15) == 0


def test_fail_after_tokens_kills_the_process_mid_stream(procs):
    address, proc = start_mocker(procs, "--fail-after-tokens", "25", "--speedup", "10")
    with grpc.insecure_channel(address) as channel:
        reader = Reader(generate(channel, 200))
        reader.join(20)
        assert not reader.finished and reader.error is not None
        assert reader.error.code() == grpc.StatusCode.UNAVAILABLE
        assert 0 < len(reader.tokens) <= 25
        assert reader.tokens == continue_sequence(PROMPT, len(reader.tokens))
    assert proc.popen.wait(timeout=10) == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "0"], "--workers"),
        (["--speedup", "-1"], "--speedup"),
        (["--not-ready", "other"], "--not-ready"),
        (["--model", "m"], "twice"),
        (["--listen", "nonsense"], "HOST:PORT"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(flags, message):
    args = [command("mocker"), "serve", "--listen", "127.0.0.1:0", "--pool-id", "p", "--model", "m", *flags]
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert message in done.stderr
