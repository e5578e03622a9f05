"""End to end, real processes: a tenant budget shared through etcd by two frontends holds in any
window across a frontend restart; residency and model access are hard filters; SIGHUP reloads the policy.

The budget test shortens the "minute" to a 10 s window ([budget] minute_seconds = 10) to stay fast.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.errors import detail_of, reason_of
from meshlaunch import MODEL, Mesh, process_group, route, wait_until
from tests.discovery.etcd_support import running_etcd

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

WINDOW = 10.0
BUCKETS = 10
LIMIT = 10_000
CHUNK = 1_000  # chunk_fraction 0.1 of the limit
PROMPT = 100
MAX_TOKENS = 100
CLIENTS = 6


def _generate(address: str, model: str = MODEL, *, max_tokens: int = MAX_TOKENS, tokens=None):
    """(trailing metadata, generated token count) of one gRPC Generate; raises grpc.RpcError."""
    prompt = tokens or [(7 * i + 3) % 5000 for i in range(PROMPT)]
    with grpc.insecure_channel(address) as channel:
        call = router_pb2_grpc.RouterServiceStub(channel).Generate(
            router_pb2.GenerateRequest(
                model=model,
                prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=prompt)),
                max_tokens=max_tokens,
            ),
            timeout=30,
        )
        count = sum(len(r.tokens.token_ids) for r in call if r.WhichOneof("payload") == "tokens")
        return dict(call.trailing_metadata()), count


def _reset_seconds(text: str) -> float:
    if text.endswith("ms"):
        return int(text[:-2]) / 1000
    total, number = 0.0, ""
    for ch in text:
        if ch.isdigit():
            number += ch
        else:
            total += int(number) * {"h": 3600, "m": 60, "s": 1}[ch]
            number = ""
    return total


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_two_frontends_sharing_a_budget_through_etcd_serve_at_most_the_limit_in_any_window(tmp_path, how):
    """Clients start late in a wall-clock window and spend the budget before its boundary (where
    fixed windows started over and admitted the limit again), frontend 0 restarts just after
    it, and they keep asking for more than the budget through two more windows. Every interval
    of WINDOW seconds, wherever it starts, stays within the limit."""
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f"[budget]\nminute_seconds = {WINDOW}\nbuckets = {BUCKETS}\nchunk_fraction = 0.1\n\n"
        f"[identity.unchecked]\ntokens_per_minute = {LIMIT}\n"
    )
    with running_etcd() as etcd, process_group(tmp_path) as group:
        m = Mesh(group)
        m.start_discovery()
        m.start_pool("pool-a", "eu", "--workers", "8", "--speedup", "50")
        flags = ("--policy", str(policy), "--budget-etcd-endpoints", etcd)
        routers = [m.start_router(*flags), m.start_router(*flags)]
        for r in routers:
            m.wait_routable(r, m.pools)
        addresses = [r.address for r in routers]
        served: list[tuple[float, float, int]] = []  # (sent, answered, prompt + generated) per request
        resets: list[float] = []
        refusals: list[grpc.RpcError] = []
        lock = threading.Lock()
        stop = threading.Event()

        def client(which: int) -> None:
            while not stop.is_set():
                sent = time.time()
                try:
                    metadata, generated = _generate(addresses[which])
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        with lock:
                            refusals.append(exc)
                        time.sleep(0.1)
                    else:  # the frontend being restarted: try again shortly
                        time.sleep(0.05)
                    continue
                with lock:
                    served.append((sent, time.time(), PROMPT + generated))
                    resets.append(_reset_seconds(metadata["x-ratelimit-reset-tokens"]))

        # Start 3.5 s before a wall-clock window boundary.
        time.sleep((WINDOW - 3.5 - time.time()) % WINDOW)
        boundary = math.ceil(time.time() / WINDOW) * WINDOW
        threads = [threading.Thread(target=client, args=(i % 2,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        # Just past the boundary frontend 0 restarts (SIGTERM: it gives its unused chunk back;
        # SIGKILL: the chunk counts until its bucket leaves the horizon), then a new process on
        # the same etcd: what it reserved is still counted there.
        time.sleep(max(0.0, boundary + 0.5 - time.time()))
        if how == "sigterm":
            routers[0].proc.terminate()
        else:
            routers[0].proc.kill9()
        restarted = m.start_router(*flags)
        m.wait_routable(restarted, m.pools)
        addresses[0] = restarted.address
        time.sleep(max(0.0, boundary + 2.2 * WINDOW - time.time()))
        stop.set()
        for t in threads:
            t.join(timeout=40)
        # A request counts at its admission, somewhere between sending and the answer: counted
        # in every interval its [sent, answered] meets. That over-counts by at most the requests
        # in flight at the interval's two ends (2 x CLIENTS x (PROMPT + MAX_TOKENS) = 2,400),
        # within the goal's one chunk per frontend (3 x 1,000: two frontends and the restarted one).
        served.sort()
        first, last = served[0][0], max(t1 for _t0, t1, _n in served)
        peak = 0.0
        for step in range(int((last - first) / 0.05) + 1):
            start = first + 0.05 * step
            total = sum(n for t0, t1, n in served if t1 >= start and t0 < start + WINDOW)
            peak = max(peak, total)
            assert total <= LIMIT + 3 * CHUNK, (how, start - boundary, total)
        print(
            f"{how}: {len(served)} requests, {sum(n for *_t, n in served)} tokens, peak {peak:g} in any {WINDOW:g} s"
        )
        # The budget is usable: some interval came close to the limit.
        assert peak >= LIMIT - 3 * (CHUNK + PROMPT + MAX_TOKENS), peak
        assert len(refusals) > 0, "the clients asked for more than the budget"
        assert {reason_of(e) for e in refusals} == {"BUDGET_EXCEEDED"}
        quota = _detail(refusals[0], error_details_pb2.QuotaFailure)
        assert quota.violations[0].subject == "tenant:unchecked"
        # Enough frees for a request at the latest when the newest bucket leaves the horizon.
        horizon = WINDOW + WINDOW / BUCKETS
        for refusal in refusals:
            assert (
                1 <= _detail(refusal, error_details_pb2.RetryInfo).retry_delay.seconds <= math.ceil(horizon)
            )
        assert resets and all(0 < r <= math.ceil(horizon) for r in resets), sorted(set(resets))
        assert (
            restarted.metric(
                "globalrouter_tenant_budget_refusals_total", limit="tokens_per_minute", tenant="unchecked"
            )
            > 0
        )


def test_residency_and_model_access_are_hard_filters_and_sighup_reloads_the_policy(tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text(f'[identity.unchecked]\nregions = ["eu"]\nmodels = ["{MODEL}"]\n')
    with process_group(tmp_path) as group:
        m = Mesh(group)
        m.start_discovery()
        m.start_pool("pool-eu", "eu", "--speedup", "50")
        m.start_pool("pool-us", "us", "--speedup", "50")
        router = m.start_router("--policy", str(policy))
        m.wait_routable(router, m.pools)
        reply = route(router.address, list(range(40)))
        assert [c.pool_id for c in reply.candidates] == ["pool-eu"]
        assert [(f.pool_id, f.reason) for f in reply.filtered] == [
            ("pool-us", router_pb2.FILTER_REASON_REGION_NOT_ALLOWED)
        ]
        for _ in range(4):
            _, generated = _generate(router.address, max_tokens=4)
            assert generated == 4
        assert router.metric("globalrouter_decisions_total", pool="pool-us") == 0
        with pytest.raises(grpc.RpcError) as caught:
            _generate(router.address, "another-model")
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert reason_of(caught.value) == "MODEL_NOT_ALLOWED"
        # Only a region no pool is in: the usual no-eligible-pool answer, naming the residency filter.
        policy.write_text(f'[identity.unchecked]\nregions = ["ap"]\nmodels = ["{MODEL}"]\n')
        os.kill(router.proc.pid, signal.SIGHUP)

        def refused_for_residency() -> bool:
            try:
                _generate(router.address, max_tokens=2)
            except grpc.RpcError as exc:
                return exc.code() == grpc.StatusCode.UNAVAILABLE and "region not allowed" in (
                    exc.details() or ""
                )
            return False

        wait_until(refused_for_residency, 10, message="the reloaded policy's residency applies")
        assert reason_of(_catch(lambda: _generate(router.address, max_tokens=2))) == "NO_ELIGIBLE_POOL"
        assert (
            router.metric(
                "globalrouter_tenant_filter_refusals_total", tenant="unchecked", reason="REGION_NOT_ALLOWED"
            )
            > 0
        )
        # A bad file on SIGHUP is refused and the policy in force stays; the process serves on.
        policy.write_text("[identity.unchecked]\npriority = 99\n")
        os.kill(router.proc.pid, signal.SIGHUP)
        wait_until(lambda: "policy file refused" in router.proc.output(), 10, message="the refusal logged")
        assert "priority" in router.proc.output()
        router.proc.check_alive()
        assert reason_of(_catch(lambda: _generate(router.address, max_tokens=2))) == "NO_ELIGIBLE_POOL"


def _detail(error: grpc.RpcError, kind):
    """The detail of type `kind` a failed call's status carries."""
    message = detail_of(error, kind)
    assert message is not None, f"no {kind.__name__} in {error}"
    return message


def _catch(call) -> grpc.RpcError:
    try:
        call()
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


def _post(port: int, body: dict) -> tuple[int, dict[str, str], dict]:
    """(status, headers, JSON body) of a POST /v1/completions to the HTTP front."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, {k.lower(): v for k, v in reply.headers.items()}, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, json.loads(exc.read())


def test_the_http_front_applies_the_same_policy_403_and_429_in_openai_shape(tmp_path):
    from meshlaunch import free_port

    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[identity.unchecked]\nrequests_per_minute = 3\ntokens_per_minute = 100000\nmodels = ["{MODEL}"]\n'
    )
    with process_group(tmp_path) as group:
        m = Mesh(group)
        m.start_discovery()
        m.start_pool("pool-a", "eu", "--speedup", "50")
        port = free_port()
        router = m.start_router("--policy", str(policy), "--http-listen", f"127.0.0.1:{port}")
        m.wait_routable(router, m.pools)
        status, headers, body = _post(port, {"model": "another-model", "prompt": "hi", "max_tokens": 2})
        assert status == 403 and body["error"]["code"] == "MODEL_NOT_ALLOWED", body
        for left in (2, 1, 0):
            status, headers, body = _post(port, {"model": MODEL, "prompt": "hello", "max_tokens": 3})
            assert status == 200, body
            assert headers["x-ratelimit-limit-requests"] == "3"
            assert headers["x-ratelimit-remaining-requests"] == str(left)
            assert headers["x-ratelimit-limit-tokens"] == "100000"
            assert "x-ratelimit-reset-tokens" in headers and "x-ratelimit-reset-requests" in headers
        status, headers, body = _post(port, {"model": MODEL, "prompt": "hello", "max_tokens": 3})
        assert status == 429, body
        assert body["error"]["type"] == "requests" and body["error"]["code"] == "BUDGET_EXCEEDED"
        assert (
            "Rate limit reached for unchecked on requests per min (RPM): Limit 3" in body["error"]["message"]
        )
        # The first request's bucket (6 s of the minute) leaves the 11-bucket horizon within 66 s.
        assert 1 <= int(headers["retry-after"]) <= 66
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert (
            router.metric(
                "globalrouter_tenant_budget_refusals_total", tenant="unchecked", limit="requests_per_minute"
            )
            == 1
        )
        assert router.metric("globalrouter_tenant_tokens_total", tenant="unchecked") > 0
