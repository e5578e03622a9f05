"""`globalrouter generate`: one request through a global frontend, printed as text or one JSON object."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.blocks import text_to_tokens
from meshkit.channels import sync_channel
from meshkit.cli import add_security_flags, host_port
from meshkit.errors import reason_of


def token_list(value: str) -> list[int]:
    """argparse type: comma-separated token ids, each 0 to 2^32-1."""
    try:
        ids = [int(t) for t in value.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {value!r}") from exc
    if not ids or any(not 0 <= t < 2**32 for t in ids):
        raise argparse.ArgumentTypeError("expected at least one token id, each 0 to 4294967295")
    return ids


def generate(router: str, model: str, tokens: list[int], max_tokens: int, timeout: float = 120.0) -> dict:
    """Calls Generate and returns the outcome as a dict (tokens, pools, migrations, finish_reason, ...).

    Raises grpc.RpcError on failure; the tokens streamed before a failure are lost to the caller
    of this helper but are printed by the CLI as they arrive.
    """
    request = router_pb2.GenerateRequest(
        model=model,
        prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens)),
        max_tokens=max_tokens,
    )
    out: list[int] = []
    summary = router_pb2.GenerateSummary()
    chunk_pools: list[str] = []
    with sync_channel(router) as channel:
        for msg in router_pb2_grpc.RouterServiceStub(channel).Generate(request, timeout=timeout):
            if msg.WhichOneof("payload") == "tokens":
                out.extend(msg.tokens.token_ids)
                chunk_pools.append(msg.tokens.pool_id)
            else:
                summary = msg.summary
    return {
        "tokens": out,
        "pools": list(summary.pools),
        "migrations": summary.migrations,
        "finish_reason": router_pb2.FinishReason.Name(summary.finish_reason)
        .removeprefix("FINISH_REASON_")
        .lower(),
        "cached_blocks": summary.cached_blocks,
        "prompt_blocks": summary.prompt_blocks,
        "tokens_generated": summary.tokens_generated,
        "refused_by": list(summary.refused_by),
        "request_id": summary.request_id,
    }


def add_parser(subparsers) -> None:
    """`globalrouter generate` flags."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "generate",
        help="send one request through a global frontend",
        description="Send one Generate request to a global frontend and print the result.",
    )
    p.add_argument("--router", type=host_port, required=True, help="global frontend HOST:PORT")
    p.add_argument("--model", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt (one token per UTF-8 byte)")
    src.add_argument("--tokens", type=token_list, help="prompt as comma-separated token ids")
    p.add_argument("--max-tokens", type=int, required=True, help="output tokens at most")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole call")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_security_flags(p, server=False)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    tokens = args.tokens if args.tokens is not None else text_to_tokens(args.prompt)
    try:
        result = generate(args.router, args.model, tokens, args.max_tokens, args.timeout)
    except grpc.RpcError as exc:
        reason = reason_of(exc)  # the stable value to decide on; the message is for people
        if args.json:
            print(json.dumps({"error": exc.code().name, "reason": reason, "message": exc.details()}))
        else:
            print(
                f"error: {exc.code().name}{f' ({reason})' if reason else ''}: {exc.details()}",
                file=sys.stderr,
            )
        return 1
    if args.json:
        print(json.dumps(result))
        return 0
    print("tokens:", ",".join(map(str, result["tokens"])))
    print(
        f"finish: {result['finish_reason']}; pools: {' -> '.join(result['pools'])}; "
        f"migrations: {result['migrations']}; cached blocks: {result['cached_blocks']}/{result['prompt_blocks']}"
        + (f"; refused by: {', '.join(result['refused_by'])}" if result["refused_by"] else "")
    )
    return 0
