"""The whole mesh on one machine: discovery, three pools with relays, two global frontends, a workload,
a drain and a crash with migration — each step explained in plain sentences."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import signal
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import FrameType

import grpc
import openai

from demo.openai_chat import chat, demo_tokenizer
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.channels import sync_channel, use_security
from meshkit.devcerts import write_dev_pki
from meshkit.tls import DEFAULT_TRUST_DOMAIN, SecurityConfig
from meshlaunch import MODEL, LaunchError, Mesh, RouterProc, free_port, local_mesh, route, wait_until
from mocker.tokens import continue_sequence

POOLS = (  # pool id, region, workers (pools differ in size)
    ("pool-eu-small", "eu-west", 1),
    ("pool-eu-large", "eu-west", 4),
    ("pool-us", "us-east", 2),
)
SPEEDUP = "10"


class DemoFailed(Exception):
    """The mesh did something the demo's story says it does not."""


def say(text: str) -> None:
    print(text, flush=True)


def prefix(seed: int, length: int, vocab: int) -> list[int]:
    """A deterministic 'system prompt' of `length` tokens, ids of the model's vocabulary (the
    frontend refuses ids past its --tokenizer's vocabulary)."""
    return [(seed * 7919 + i * 31) % vocab for i in range(length)]


Result = tuple[list[int], router_pb2.GenerateSummary]


def generate(
    address: str, tokens: list[int], max_tokens: int, on_token: Callable[[int, str], object] | None = None
) -> Result:
    """(tokens, summary) of one Generate; `on_token(count, pool)` is called as tokens arrive."""
    out: list[int] = []
    summary: router_pb2.GenerateSummary | None = None
    request = router_pb2.GenerateRequest(
        model=MODEL,
        prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens)),
        max_tokens=max_tokens,
    )
    with sync_channel(address) as channel:  # over mutual TLS with --secure
        for msg in router_pb2_grpc.RouterServiceStub(channel).Generate(request, timeout=60):
            if msg.WhichOneof("payload") == "summary":
                summary = msg.summary
            else:
                out.extend(msg.tokens.token_ids)
                if on_token is not None:
                    on_token(len(out), msg.tokens.pool_id)
    if summary is None:
        raise DemoFailed(f"a Generate at {address} ended without its summary")
    return out, summary


def workload(mesh: Mesh, vocab: int) -> tuple[dict[str, list[int]], dict[str, set[str]]]:
    say("\nStep 2 — a workload with shared prefixes. Three 'applications' each send 8 requests that")
    say("share a long system prompt (384 tokens = 24 blocks of 16), alternating between the two global")
    say(
        "frontends, 6 at a time, each asking for 128 output tokens. The routers should learn where each prefix is cached and send the"
    )
    say("followers there.")
    apps = {f"app-{k}": prefix(k + 1, 384, vocab) for k in range(3)}
    jobs = [(app, i) for i in range(8) for app in apps]
    stats: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def one(job: tuple[str, int]) -> tuple[str, router_pb2.GenerateSummary]:
        app, i = job
        router = mesh.routers[i % 2]
        time.sleep(0.05 * i)  # followers come a little later, like real traffic
        return app, generate(router.address, [*apps[app], 10 + i], 128)[1]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, jobs))
    homes: dict[str, set[str]] = defaultdict(set)
    for app, summary in results:
        pool_id = summary.pools[0]
        homes[app].add(pool_id)
        s = stats[pool_id]
        s["requests"] += 1
        s["cached"] += summary.cached_blocks
        s["prompt"] += summary.prompt_blocks
        s["migrations"] += summary.migrations
    table(stats)
    for app in apps:
        say(f"  {app}'s requests went to: {', '.join(sorted(homes[app]))}")
    total_cached = sum(s["cached"] for s in stats.values())
    total_prompt = sum(s["prompt"] for s in stats.values())
    say(
        f"Overall {total_cached} of {total_prompt} prompt blocks ({100 * total_cached / max(total_prompt, 1):.0f}%)"
        " were already cached at the pool that served them: each application's first request filled a"
        " pool's cache, and the routers, which see every pool's cached blocks over telemetry, sent the"
        " followers to that pool unless it was busier."
    )
    probe = [*apps["app-0"], 5]
    firsts = [route(r.address, probe).candidates[0] for r in mesh.routers]
    say(
        "Asked for a dry run (Route) of another app-0 request, "
        + " and ".join(
            f"frontend {k + 1} ranks {c.pool_id} first ({c.cached_blocks} of {c.prompt_blocks} blocks cached there)"
            for k, c in enumerate(firsts)
        )
        + ": the two frontends route alike from the same telemetry.\n"
    )
    return apps, homes


def table(stats: dict[str, dict[str, int]]) -> None:
    say(f"\n  {'pool':<15} {'requests':>8} {'cached prefix':>14} {'migrations':>10}")
    for pool_id, _region, _workers in POOLS:
        s = stats.get(pool_id, {})
        ratio = f"{100 * s.get('cached', 0) / s['prompt']:.0f}%" if s.get("prompt") else "-"
        say(f"  {pool_id:<15} {s.get('requests', 0):>8} {ratio:>14} {s.get('migrations', 0):>10}")
    say("")


def drain(mesh: Mesh, apps: dict[str, list[int]], homes: dict[str, set[str]]) -> str:
    app = "app-1"
    victim = sorted(homes[app])[0]
    say(f"Step 3 — drain. {app}'s prefix lives at {victim}. A long {app} request (400 tokens) starts there;")
    say(f"then an operator asks discovery to drain {victim} (DrainPool, 3 s deadline).")
    started: list[str] = []  # the pool that sent the long request's first tokens
    finished: list[Result] = []

    def first_tokens(count: int, pool_id: str) -> None:
        if not started:
            started.append(pool_id)

    def long_request() -> None:
        finished.append(generate(mesh.routers[0].address, [*apps[app], 30], 400, first_tokens))

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_until(lambda: started, 10, message="the long request starts")
    mesh.drain(victim, 3.0)
    for router in mesh.routers:
        wait_until(partial(draining, router, victim), 10, message="routers learn of the drain")
    say(f"  Both global frontends now list {victim} as draining and stop choosing it for new work.")
    served = [generate(mesh.routers[i % 2].address, [*apps[app], 20 + i], 8)[1].pools[0] for i in range(4)]
    say(
        f"  Four new {app} requests went to: {', '.join(served)} — none to {victim}, even though it holds the prefix."
    )
    if victim in served:
        raise DemoFailed(f"a new request went to {victim} after it was drained")
    thread.join(30)
    if not finished:
        raise DemoFailed("the long request started before the drain did not finish within 30 s")
    tokens, summary = finished[0]
    if summary.pools[0] == victim:
        say(
            f"  The long request that {victim} had accepted before the drain ran to completion there: "
            f"{len(tokens)} tokens, {summary.migrations} migrations."
        )
    else:
        say(f"  (The long request had gone to {summary.pools[0]}; it finished with {len(tokens)} tokens.)")
    for router in mesh.routers:
        wait_until(partial(unlisted, router, victim), 15, message="drained pool leaves")
    say(f"  At its deadline the drain completed and {victim} left the directory of both frontends.\n")
    return victim


def draining(router: RouterProc, pool_id: str) -> bool:
    return router.pools()[pool_id].draining


def unlisted(router: RouterProc, pool_id: str) -> bool:
    views = router.pools()
    return pool_id not in views or not views[pool_id].listed


def crash(mesh: Mesh, drained: str, vocab: int) -> None:
    left = [p for p in mesh.pools if p != drained]
    say(f"Step 4 — a crash mid-stream. {' and '.join(left)} remain. A request for 600 tokens starts; after")
    say("40 tokens the pool serving it is killed with SIGKILL (no goodbye, no drain).")
    prompt = [*prefix(9, 200, vocab), 7]
    killed: list[str] = []

    def on_token(count: int, pool_id: str) -> None:
        if count >= 40 and not killed:
            killed.append(pool_id)
            mesh.pools[pool_id].pool.kill9()
            say(f"  {pool_id} was killed after {count} tokens had reached the client.")

    tokens, summary = generate(mesh.routers[0].address, prompt, 600, on_token)
    expected = continue_sequence(prompt, 600, vocab)
    say(
        f"  The request finished with {len(tokens)} tokens, served by {' then '.join(summary.pools)} "
        f"({summary.migrations} migration): the router replayed the prompt plus the tokens so far to another pool."
    )
    same = tokens == expected
    say(
        "  The client's tokens are identical to an uninterrupted run's: nothing lost, nothing repeated."
        if same
        else "  MISMATCH: the client's tokens differ from an uninterrupted run!"
    )
    if not same or summary.migrations != 1:
        raise DemoFailed(f"expected identical tokens after exactly 1 migration, got {summary.migrations}")
    migrations = mesh.routers[0].metric("globalrouter_migrations_total", from_pool=killed[0])
    say(
        f'  The router\'s metrics count it too: globalrouter_migrations_total{{from_pool="{killed[0]}"}} = {migrations:g}\n'
    )


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # SystemExit unwinds through local_mesh, which stops every process the demo started.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__)
    parser.add_argument(
        "--secure", action="store_true", help="run every link over mutual TLS (a dev CA made for the run)"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            certs = None
            if args.secure:
                certs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mesh-certs-")))
                _make_certs(certs)
            run(certs)
    except (LaunchError, DemoFailed, grpc.RpcError, openai.OpenAIError) as exc:
        say(f"\nThe demo failed: {exc}")
        return 1
    say(f"All processes stopped. The demo took {time.monotonic() - started:.0f} s.")
    return 0


def _make_certs(certs: Path) -> None:
    """A dev CA and a certificate per process of the demo; this process dials as the client `demo`."""
    write_dev_pki(
        certs,
        trust_domain=DEFAULT_TRUST_DOMAIN,
        pools=[p for p, _r, _w in POOLS],
        frontends=["router-1", "router-2"],
    )
    use_security(
        SecurityConfig(
            tls_cert=str(certs / "client.crt"),
            tls_key=str(certs / "client.key"),
            tls_ca=str(certs / "ca.crt"),
        )
    )


def run(certs: Path | None = None) -> None:
    with local_mesh(certs=certs) as mesh, tempfile.TemporaryDirectory(prefix="demo-tokenizer-") as tmp:
        tokenizer, vocab = demo_tokenizer(Path(tmp))
        http: list[str] = []
        say("Step 1 — start the mesh on 127.0.0.1 (free ports; logs in a temporary directory).")
        if certs is not None:
            say(
                "  Over mutual TLS: a dev CA signed a certificate per process, naming its identity"
                " (spiffe://mesh.local/relay/POOL/RELAY, /frontend/ID, /client/demo, /admin/ops); every"
                " call is checked against SECURITY.md's authorization table."
            )
        mesh.start_discovery()
        say(f"  Discovery is up at {mesh.discovery} (heartbeat 0.5 s, lease 1.5 s).")
        for pool_id, region, workers in POOLS:
            p = mesh.start_pool(
                pool_id, region, "--workers", str(workers), "--speedup", SPEEDUP, "--vocab-size", str(vocab)
            )
            say(
                f"  Pool {pool_id} ({region}, {workers} worker{'s' if workers > 1 else ''}) serves at {p.url}; its relay registers it."
            )
        for _ in range(2):
            http.append(f"127.0.0.1:{free_port()}")
            r = mesh.start_router("--http-listen", http[-1], "--tokenizer", f"{MODEL}={tokenizer}")
            say(
                f"  Global frontend at {r.address} (OpenAI HTTP API at {'https' if certs else 'http'}://{http[-1]}/v1) registered with "
                "discovery; relays dial in with telemetry."
            )
        for router in mesh.routers:
            mesh.wait_routable(router, mesh.pools)
        say("  Both frontends list all three pools with fresh load and KV telemetry.")
        apps, homes = workload(mesh, vocab)
        drained = drain(mesh, apps, homes)
        crash(mesh, drained, vocab)
        say("Step 5 — the OpenAI API. The official openai client streams a chat completion through a")
        say(
            "  frontend's HTTP port: the chat template and tokenizer turn it into tokens, the frontend routes"
        )
        say("  them like any request, and detokenizes the pool's tokens as they arrive.")
        chat(http[0], say, certs)
        say("Step 6 — stop everything.")


if __name__ == "__main__":
    sys.exit(main())
