"""A real OTLP/gRPC trace receiver for tests: the collector's TraceService, collecting every span it is sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, flattened: ids as hex, attributes as plain values."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)
    error: bool = False


def _value(v) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpReceiver) -> None:
        self.sink = sink

    def Export(self, request, context):
        spans: list[ReceivedSpan] = []
        for rs in request.resource_spans:
            service = next(
                (a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), ""
            )
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        ReceivedSpan(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            error=s.status.code == 2,  # STATUS_CODE_ERROR
                        )
                    )
        self.sink.add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """Serves opentelemetry.proto.collector.trace.v1.TraceService on 127.0.0.1 (a free port)."""

    def __init__(self, credentials: grpc.ServerCredentials | None = None) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.exports = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self.server)
        if credentials is None:
            port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.endpoint = f"127.0.0.1:{port}"
        self.server.start()

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)
            self.exports += 1

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, check: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0
    ) -> list[ReceivedSpan]:
        """The spans once `check` holds on them; AssertionError naming what came after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if check(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name, s.trace_id[:8]) for s in spans})
                raise AssertionError(f"spans after {timeout:.0f} s do not satisfy the check: {names}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.stop(grace=None)
