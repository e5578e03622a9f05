"""Writes deploy/grafana/global-router.json: the Grafana dashboard of the mesh's Prometheus metrics.

The JSON is generated so that every panel has the same shape and ids stay consistent; edit the
PANELS table and run `python deploy/grafana/make_dashboard.py`. tests/deploy checks that the
committed JSON is current and that every query names a metric the processes export.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("global-router.json")

# (row, title, unit, description, [(PromQL, legend)]). $__rate_interval and the datasource variable
# are Grafana's; {{label}} legends name the series.
PANELS: list[tuple[str, str, str, str, list[tuple[str, str]]]] = [
    (
        "Requests",
        "Requests by outcome",
        "reqps",
        "Generate requests (gRPC and HTTP) by gRPC outcome code; OK is success.",
        [("sum by (outcome) (rate(globalrouter_requests_total[$__rate_interval]))", "{{outcome}}")],
    ),
    (
        "Requests",
        "Errors by reason",
        "reqps",
        "Requests that did not end OK, pool admission refusals by code, and authorization refusals.",
        [
            (
                'sum by (outcome) (rate(globalrouter_requests_total{outcome!="OK"}[$__rate_interval]))',
                "request {{outcome}}",
            ),
            ("sum by (code) (rate(globalrouter_refusals_total[$__rate_interval]))", "pool refused {{code}}"),
            ("sum by (code) (rate(mesh_auth_refusals_total[$__rate_interval]))", "auth {{code}}"),
        ],
    ),
    (
        "Requests",
        "HTTP responses by status",
        "reqps",
        "OpenAI API responses by route and status (streams count when they start).",
        [("sum by (status) (rate(globalrouter_http_responses_total[$__rate_interval]))", "{{status}}")],
    ),
    (
        "Latency",
        "Time to first token",
        "s",
        "From the request's arrival at the frontend to its first token, admission and any retries included.",
        [
            (
                "histogram_quantile(0.5, sum by (le) (rate(globalrouter_time_to_first_token_seconds_bucket[$__rate_interval])))",
                "p50",
            ),
            (
                "histogram_quantile(0.99, sum by (le) (rate(globalrouter_time_to_first_token_seconds_bucket[$__rate_interval])))",
                "p99",
            ),
        ],
    ),
    (
        "Latency",
        "Routing decision latency",
        "s",
        "Time to filter and rank the pools for one request: wall time, and the serving thread's own CPU "
        "(the gap is time the thread waited for a CPU or the GIL).",
        [
            (
                "histogram_quantile(0.99, sum by (le) (rate(globalrouter_decision_latency_seconds_bucket[$__rate_interval])))",
                "p99",
            ),
            (
                "histogram_quantile(0.99, sum by (le) (rate(globalrouter_decision_cpu_seconds_bucket[$__rate_interval])))",
                "p99 CPU",
            ),
        ],
    ),
    (
        "Routing",
        "Cached-prefix ratio",
        "percentunit",
        "Prompt blocks the chosen pools had cached at admission, over all prompt blocks.",
        [
            (
                "sum(rate(globalrouter_cached_blocks_total[$__rate_interval])) / sum(rate(globalrouter_prompt_blocks_total[$__rate_interval]))",
                "cached / prompt blocks",
            ),
        ],
    ),
    (
        "Routing",
        "Cached prefix: available vs achieved",
        "percentunit",
        "Per admission, as the frontend's KV index saw it: the mean cached share of the prompt at the pool"
        " that admitted the request (achieved) and at the best-cached eligible pool (available). The gap is"
        " cache given up to the load, the hotspot term or a refusal.",
        [
            (
                "sum(rate(globalrouter_cached_prefix_achieved_ratio_sum[$__rate_interval])) / sum(rate(globalrouter_cached_prefix_achieved_ratio_count[$__rate_interval]))",
                "achieved",
            ),
            (
                "sum(rate(globalrouter_cached_prefix_available_ratio_sum[$__rate_interval])) / sum(rate(globalrouter_cached_prefix_available_ratio_count[$__rate_interval]))",
                "available",
            ),
        ],
    ),
    (
        "Routing",
        "Cached tokens forgone",
        "short",
        "Prompt tokens per second the admitting pools prefilled beyond what the best-cached eligible pool"
        " would have (cache given up to balance load, or after a refusal).",
        [("sum(rate(globalrouter_cached_prefix_forgone_tokens_total[$__rate_interval]))", "tokens/s")],
    ),
    (
        "Routing",
        "Requests per pool",
        "reqps",
        "Admission attempts sent to each pool.",
        [("sum by (pool) (rate(globalrouter_decisions_total[$__rate_interval]))", "{{pool}}")],
    ),
    (
        "Routing",
        "Migrations",
        "ops",
        "Streams moved mid-way off a failed pool, and streams ended at the migration limit.",
        [
            (
                "sum by (from_pool) (rate(globalrouter_migrations_total[$__rate_interval]))",
                "from {{from_pool}}",
            ),
            ("sum(rate(globalrouter_migration_aborts_total[$__rate_interval]))", "aborted at the limit"),
        ],
    ),
    (
        "Pools",
        "Pools by state",
        "short",
        "Pools in each frontend's directory by state (the highest count over frontends).",
        [("max by (state) (globalrouter_pools)", "{{state}}")],
    ),
    (
        "Pools",
        "KV view age",
        "s",
        "Seconds since each pool's last KV message (snapshot chunk, delta or heartbeat), the oldest view over"
        " frontends; past --kv-max-age (30 s by default) the router treats the pool as caching nothing.",
        [("max by (pool) (globalrouter_pool_kv_age_seconds)", "{{pool}}")],
    ),
    (
        "Pools",
        "Telemetry lag",
        "s",
        "Receive time at the frontend minus the relay's observe time, over all telemetry.",
        [
            (
                "histogram_quantile(0.99, sum by (le) (rate(globalrouter_telemetry_lag_seconds_bucket[$__rate_interval])))",
                "p99",
            )
        ],
    ),
    (
        "Pools",
        "Lease grace",
        "short",
        "Pools kept routable after their discovery lease lapsed while their telemetry is live (one lease at"
        " most: a discovery outage), the most over frontends, and how each grace ended.",
        [
            ("max(globalrouter_pools_in_lease_grace)", "in grace"),
            (
                "sum by (outcome) (increase(globalrouter_pool_lease_grace_total[$__rate_interval]))",
                "{{outcome}}",
            ),
        ],
    ),
    (
        "Pools",
        "Relays registered",
        "short",
        "Relays whose pool is registered with discovery (1) or not (0).",
        [("sum by (pool_id) (poolrelay_registered)", "{{pool_id}}")],
    ),
]


def dashboard() -> dict:
    panels: list[dict] = []
    y = 0
    row = None
    x = 0
    for n, (row_title, title, unit, description, queries) in enumerate(PANELS, start=1):
        if row_title != row:
            row = row_title
            if x:
                y += 8
                x = 0
            panels.append(
                {
                    "type": "row",
                    "title": row_title,
                    "id": 100 + n,
                    "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                    "panels": [],
                }
            )
            y += 1
        panels.append(
            {
                "id": n,
                "type": "timeseries",
                "title": title,
                "description": description,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {
                    "legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"},
                },
                "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
                "targets": [
                    {
                        "refId": chr(ord("A") + i),
                        "expr": expr,
                        "legendFormat": legend,
                        "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    }
                    for i, (expr, legend) in enumerate(queries)
                ],
            }
        )
        x = 12 - x
        if x == 0:
            y += 8
    return {
        "title": "Global Router",
        "uid": "global-router",
        "description": "Requests, errors, latency, routing quality, pools and telemetry of a Global Router mesh.",
        "tags": ["global-router", "llm", "routing"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    OUT.write_text(render())
    sys.stderr.write(f"wrote {OUT}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
