"""`globalrouter generate` and its client library: one request through a replicated mesh, failing
over between global frontends mid-stream with no token lost or repeated."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.blocks import text_to_tokens
from meshkit.channels import sync_channel
from meshkit.cli import add_security_flags, host_port, int_at_least
from meshkit.errors import Reason, reason_of

# Fail-over back-off: none after a frontend that streamed tokens; after one that gave nothing the
# client waits 50 ms, doubling while every frontend keeps failing (a whole-mesh restart) up to 1 s,
# with jitter so that N clients do not hammer the survivors in lock-step.
FAILOVER_FIRST_WAIT_S = 0.05
FAILOVER_MAX_WAIT_S = 1.0


def failover_wait(barren: int) -> float:
    """Seconds to wait after `barren` fail-overs in a row that brought no token (>= 1)."""
    base = min(FAILOVER_FIRST_WAIT_S * 2 ** (barren - 1), FAILOVER_MAX_WAIT_S)
    return base * (1 + random.random() / 2)


@dataclass(frozen=True)
class FailoverPolicy:
    """How many fail-overs one request may make, bounded whatever the size of the fleet.

    Every frontend gets a couple of chances (`per_frontend` x the frontends known), but never more
    than `max_failovers` in all: with 50 frontends a request that keeps failing is not retried 100
    times. The defaults keep the small meshes' budget (1 frontend: 2 fail-overs, 2: 4).
    """

    per_frontend: int = 2
    max_failovers: int = 4

    def __post_init__(self) -> None:
        if self.per_frontend < 1:
            raise ValueError(f"FailoverPolicy.per_frontend must be >= 1 (got {self.per_frontend})")
        if self.max_failovers < 0:
            raise ValueError(f"FailoverPolicy.max_failovers must be >= 0 (got {self.max_failovers})")

    def limit(self, frontends: int) -> int:
        """Fail-overs allowed for one request across `frontends` known frontends."""
        return min(self.per_frontend * frontends, self.max_failovers)


DEFAULT_FAILOVER = FailoverPolicy()
# Codes a frontend's own death (crash, kill -9, stop, broken connection) shows as, decided on the
# status code's origin as gRPC defines it (doc/statuscodes.md), never on its text: grpc reports a
# lost peer or connection as UNAVAILABLE (or CANCELLED), and an HTTP/2 stream reset or protocol
# error (a proxy dropping its upstream) as INTERNAL. UNKNOWN is what a server application that
# raised answers: the frontend ran the request and failed on it, so another frontend would fail
# the same way (a poisonous request is not retried across the fleet). A frontend's considered
# answer carries an ErrorInfo reason instead and is final.
_LOST_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INTERNAL,
    }
)


def token_list(value: str) -> list[int]:
    """argparse type: comma-separated token ids, each 0 to 2^32-1."""
    try:
        ids = [int(t) for t in value.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {value!r}") from exc
    if not ids or any(not 0 <= t < 2**32 for t in ids):
        raise argparse.ArgumentTypeError("expected at least one token id, each 0 to 4294967295")
    return ids


def router_list(value: str) -> list[str]:
    """argparse type: one or more global frontends, HOST:PORT[,HOST:PORT...], no duplicates."""
    routers = [host_port(r.strip()) for r in value.split(",") if r.strip()]
    if not routers:
        raise argparse.ArgumentTypeError("expected at least one HOST:PORT")
    if len(set(routers)) != len(routers):
        raise argparse.ArgumentTypeError(f"names a frontend twice: {value!r}")
    return routers


def frontend_lost(exc: grpc.RpcError) -> bool:
    """Whether a failed call means the frontend itself is gone (so another may continue the stream).

    A frontend that answers decides (NOT_FOUND, RESOURCE_EXHAUSTED, ABORTED at the migration limit,
    an UNAVAILABLE naming a reason such as NO_ELIGIBLE_POOL...): that answer is final. A connection
    that breaks, or a frontend that is shutting down, carries no reason or SHUTTING_DOWN.
    """
    if exc.code() not in _LOST_CODES:
        return False
    reason = reason_of(exc)
    return reason is None or reason == Reason.SHUTTING_DOWN


class _FrontendLost(Exception):
    """One frontend died under the stream (retried on the next one)."""

    def __init__(self, router: str, error: grpc.RpcError | None) -> None:
        detail = f"{error.code().name}: {error.details()}" if error is not None else "ended without a summary"
        super().__init__(f"{router}: {detail}")
        self.error = error


class FailoverError(Exception):
    """The request failed: a frontend's final answer, or every frontend lost. Tokens already
    received (`tokens`) are valid; `code` and `message` say why."""

    def __init__(self, code: grpc.StatusCode, message: str, tokens: list[int], reason: str | None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.tokens = tokens
        self.reason = reason


@dataclass
class GenerateResult:
    """One request's outcome across every frontend that served a part of it."""

    tokens: list[int] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)
    migrations: int = 0
    """Pool-to-pool migrations inside the frontends."""
    failovers: int = 0
    """Frontend-to-frontend continuations done by this client."""
    frontends: list[str] = field(default_factory=list)
    """The frontends that served a part of the stream, in order."""
    finish_reason: str = ""
    cached_blocks: int = 0
    prompt_blocks: int = 0
    refused_by: list[str] = field(default_factory=list)
    request_id: str = ""
    errors: list[str] = field(default_factory=list)
    """Why each fail-over happened."""

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "pools": self.pools,
            "migrations": self.migrations,
            "failovers": self.failovers,
            "frontends": self.frontends,
            "finish_reason": self.finish_reason,
            "cached_blocks": self.cached_blocks,
            "prompt_blocks": self.prompt_blocks,
            "tokens_generated": len(self.tokens),
            "refused_by": self.refused_by,
            "request_id": self.request_id,
        }


class FailoverClient:
    """A client of a replicated mesh: several global frontends, one sticky current one.

    Each request goes to the current frontend. If that frontend is lost mid-stream (its process
    dies, its connection breaks), the request continues on the next frontend with the prompt plus
    the tokens received so far and the remaining budget: the mesh's output is a function of the
    whole sequence, so the caller sees one stream with no token lost or repeated. The client stays
    on the frontend that worked.
    """

    def __init__(
        self, routers: Sequence[str], *, start: int = 0, policy: FailoverPolicy = DEFAULT_FAILOVER
    ) -> None:
        if not routers:
            raise ValueError("FailoverClient needs at least one frontend address")
        self.routers = list(routers)
        self.policy = policy
        self._current = start % len(self.routers)
        self._channels: dict[str, grpc.Channel] = {}

    @property
    def current(self) -> str:
        return self.routers[self._current]

    def _stub(self, router: str) -> router_pb2_grpc.RouterServiceStub:
        channel = self._channels.get(router)
        if channel is None:
            channel = self._channels[router] = sync_channel(router)
        return router_pb2_grpc.RouterServiceStub(channel)

    def _forget(self, router: str) -> None:
        """Drops a lost frontend's channel (a restarted frontend gets a fresh connection)."""
        channel = self._channels.pop(router, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        for router in list(self._channels):
            self._forget(router)

    def __enter__(self) -> FailoverClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(
        self,
        model: str,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        timeout: float = 120.0,
        request_id: str = "",
        result: GenerateResult | None = None,
    ) -> Iterator[list[int]]:
        """Yields the output tokens batch by batch; fills `result`; raises FailoverError on failure."""
        res = result if result is not None else GenerateResult()
        deadline = time.monotonic() + timeout
        limit = self.policy.limit(len(self.routers))
        barren = 0  # fail-overs in a row that brought no token: the wait grows with them
        while True:
            before = len(res.tokens)
            try:
                yield from self._one_frontend(model, list(prompt), max_tokens, deadline, request_id, res)
                return
            except _FrontendLost as lost:
                if res.failovers >= limit:
                    raise FailoverError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"every global frontend was lost ({len(self.routers)} known, {res.failovers} "
                        f"fail-overs of {limit} allowed); last: {lost}; the {len(res.tokens)} tokens "
                        "received stay valid",
                        res.tokens,
                        None,
                    ) from None
                barren = 0 if len(res.tokens) > before else barren + 1
                self._advance()
                res.failovers += 1
                if barren:
                    time.sleep(failover_wait(barren))

    def _advance(self) -> None:
        self._forget(self.current)
        self._current = (self._current + 1) % len(self.routers)

    def _one_frontend(
        self,
        model: str,
        prompt: list[int],
        max_tokens: int,
        deadline: float,
        request_id: str,
        res: GenerateResult,
    ) -> Iterator[list[int]]:
        router = self.current
        remaining = max_tokens - len(res.tokens)
        if remaining <= 0:
            # The budget was used up just as the frontend died: nothing left to ask for.
            res.finish_reason = res.finish_reason or "length"
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise FailoverError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the request's time ran out after {len(res.tokens)} tokens",
                res.tokens,
                None,
            )
        request = router_pb2.GenerateRequest(
            model=model,
            prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=prompt + res.tokens)),
            max_tokens=remaining,
            request_id=request_id,
            combine_messages=True,  # the summary may come inside the last chunk (read below)
        )
        res.frontends.append(router)
        try:
            for msg in self._stub(router).Generate(request, timeout=left):
                if msg.WhichOneof("payload") == "tokens":
                    ids = list(msg.tokens.token_ids)[: max_tokens - len(res.tokens)]
                    if ids:
                        res.tokens.extend(ids)
                        yield ids
                    if msg.tokens.HasField("summary"):
                        self._summarize(res, msg.tokens.summary, first=len(res.frontends) == 1)
                        return
                else:
                    self._summarize(res, msg.summary, first=len(res.frontends) == 1)
                    return
        except grpc.RpcError as exc:
            if frontend_lost(exc) and exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                res.errors.append(f"{router}: {exc.code().name}: {exc.details()}")
                raise _FrontendLost(router, exc) from None
            raise FailoverError(exc.code(), exc.details() or "", res.tokens, reason_of(exc)) from None
        res.errors.append(f"{router}: the stream ended without a summary")
        raise _FrontendLost(router, None)

    @staticmethod
    def _summarize(res: GenerateResult, summary: router_pb2.GenerateSummary, *, first: bool) -> None:
        res.pools.extend(summary.pools)
        res.migrations += summary.migrations
        res.refused_by.extend(summary.refused_by)
        res.request_id = summary.request_id
        res.finish_reason = (
            router_pb2.FinishReason.Name(summary.finish_reason).removeprefix("FINISH_REASON_").lower()
        )
        if first:
            # The prompt's cache hit is the first frontend's; a continuation's prompt is longer.
            res.cached_blocks = summary.cached_blocks
            res.prompt_blocks = summary.prompt_blocks

    def generate(
        self,
        model: str,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        timeout: float = 120.0,
        request_id: str = "",
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerateResult:
        """The whole request; raises FailoverError (with the tokens received) on failure."""
        res = GenerateResult()
        for ids in self.stream(model, prompt, max_tokens, timeout=timeout, request_id=request_id, result=res):
            if on_tokens is not None:
                on_tokens(ids)
        return res


def generate(
    router: str | Sequence[str],
    model: str,
    tokens: list[int],
    max_tokens: int,
    timeout: float = 120.0,
    policy: FailoverPolicy = DEFAULT_FAILOVER,
) -> dict:
    """One request through one or several frontends; the outcome as a dict (tokens, pools,
    migrations, failovers, finish_reason, ...). Raises FailoverError on failure."""
    routers = [router] if isinstance(router, str) else list(router)
    with FailoverClient(routers, policy=policy) as client:
        return client.generate(model, tokens, max_tokens, timeout=timeout).as_dict()


def add_parser(subparsers) -> None:
    """`globalrouter generate` flags."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "generate",
        help="send one request through a global frontend",
        description="Send one Generate request to a global frontend and print the result. With several "
        "frontends, a stream whose frontend dies continues on the next one with no token lost or repeated.",
    )
    p.add_argument(
        "--router",
        type=router_list,
        required=True,
        help="global frontend(s), HOST:PORT[,HOST:PORT...]: the first is used, the others take over",
    )
    p.add_argument("--model", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt (one token per UTF-8 byte)")
    src.add_argument("--tokens", type=token_list, help="prompt as comma-separated token ids")
    p.add_argument("--max-tokens", type=int, required=True, help="output tokens at most")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole call")
    p.add_argument(
        "--max-failovers",
        type=int_at_least(0),
        default=DEFAULT_FAILOVER.max_failovers,
        help=f"fail-overs to another frontend per request at most ({DEFAULT_FAILOVER.per_frontend} per "
        "frontend known, never more than this; default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_security_flags(p, server=False)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    tokens = args.tokens if args.tokens is not None else text_to_tokens(args.prompt)
    try:
        policy = FailoverPolicy(max_failovers=args.max_failovers)
        result = generate(args.router, args.model, tokens, args.max_tokens, args.timeout, policy)
    except FailoverError as exc:
        if args.json:
            print(
                json.dumps(
                    {
                        "error": exc.code.name,
                        "message": exc.message,
                        "reason": exc.reason,
                        "tokens": exc.tokens,
                    }
                )
            )
        else:
            reason = f" ({exc.reason})" if exc.reason else ""  # the stable value to decide on
            print(f"error: {exc.code.name}{reason}: {exc.message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0
    print("tokens:", ",".join(map(str, result["tokens"])))
    print(
        f"finish: {result['finish_reason']}; pools: {' -> '.join(result['pools'])}; "
        f"migrations: {result['migrations']}; cached blocks: {result['cached_blocks']}/{result['prompt_blocks']}"
        + (f"; refused by: {', '.join(result['refused_by'])}" if result["refused_by"] else "")
        + (f"; frontends: {' -> '.join(result['frontends'])}" if result["failovers"] else "")
    )
    return 0
