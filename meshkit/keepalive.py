"""gRPC keepalive and message-size settings, defined once and shared by every client and server."""

from __future__ import annotations

# Largest message any service accepts or sends. Big enough for a chunk of a KV snapshot or a long
# prompt (1M tokens * ~5 bytes), small enough that one caller cannot exhaust memory.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024

# Clients ping an idle connection every 10 s and give up after 5 s without an answer, so a dead
# peer (a killed pool, a partitioned frontend) is noticed in seconds rather than at TCP timeout.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000

UNREQUESTED_S = 600
"""Seconds a call may wait for a busy server to pick it up (clients' own deadlines still apply)."""

CLIENT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly after a peer restarts; back-off policy lives in the callers (tenacity).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Accept the clients' ping rate above without calling it abuse.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # A call the server's loop has not picked up yet waits, instead of being cancelled after
    # gRPC's default 30 s: the asyncio server picks up about one new call per loop turn, so a
    # frontend whose loop is busy after a restart took minutes to pick up 2,000 relay streams, and
    # each cancelled one redialled and sent its whole snapshot again (the storm never ended).
    ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_S),
]
