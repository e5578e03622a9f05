"""The live status page (GET /) and its data (GET /status.json): one self-contained HTML file, no assets."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from globalrouter.routing import RoutingCore


def pool_state(core: RoutingCore, pool, now: float) -> str:
    """ready, draining, not-ready or stale (no fresh readiness or load signal), as shown on the page."""
    limits = core.selector_limits
    if pool.draining():
        return "draining"
    if not (pool.state_fresh(now, limits) or pool.load_fresh(now, limits)):
        return "stale"
    return "ready" if pool.ready(pool.model, now, limits) else "not-ready"


def pool_states(core: RoutingCore) -> Counter[str]:
    """Pools of the directory by state (pool_state), for the globalrouter_pools metric.

    Read from the metrics endpoint's thread: list() copies the table's values in one step."""
    now = core.clock.monotonic()
    return Counter(pool_state(core, p, now) for p in list(core.table.pools.values()) if p.listed)


def cached_prefix(decisions: list[dict[str, Any]]) -> dict[str, Any]:
    """Available vs achieved over the recent decisions shown: the mean cached share the admitting
    pools had and the mean best share any eligible pool had (as the KV index saw them), and how
    many decisions gave some of it up (the load or a refusal moved them off the best cache)."""
    rated = [d for d in decisions if d.get("achieved_share") is not None]
    if not rated:
        return {"decisions": 0, "achieved_mean": None, "available_mean": None, "gave_up": 0}
    return {
        "decisions": len(rated),
        "achieved_mean": round(sum(d["achieved_share"] for d in rated) / len(rated), 4),
        "available_mean": round(sum(d["available_share"] for d in rated) / len(rated), 4),
        "gave_up": sum(1 for d in rated if d["achieved_share"] < d["available_share"]),
    }


def status(core: RoutingCore, frontend_id: str, *, tenant: str | None = None) -> dict[str, Any]:
    """What the page shows: pools by region with their signals, the recent events of the core, and
    flow control per tenant and class (only `tenant`'s rows when given: a client sees its own)."""
    now = core.clock.monotonic()
    limits = core.selector_limits
    regions: dict[str, list[dict[str, Any]]] = {}
    for pool in sorted(core.table.pools.values(), key=lambda p: (p.region, p.pool_id)):
        if not pool.listed:
            continue
        ages = [now - at for at in (pool.load_at, pool.kv_at, pool.state_at) if at is not None]
        load = pool.load
        regions.setdefault(pool.region or "(none)", []).append(
            {
                "pool_id": pool.pool_id,
                "model": pool.model,
                "adapters": sorted(pool.adapters.get(pool.model, ())),
                "state": pool_state(core, pool, now),
                # "lease_lapsed" while only the lease grace keeps the pool routable (its leases
                # lapsed in discovery, its telemetry is live here), with the grace left.
                "directory_state": pool.directory_state(),
                "lease_grace_left_s": (
                    round(max(0.0, pool.lease_grace_until - now), 3)
                    if pool.lease_grace_until is not None
                    else None
                ),
                "requests_running": load.requests_running if load else None,
                "requests_waiting": load.requests_waiting if load else None,
                "max_running": load.max_running_requests if load else None,
                "kv_blocks_used": load.kv_blocks_used if load else None,
                "kv_blocks_total": load.kv_blocks_total if load else None,
                "indexed_blocks": max((core.index.block_count(s) for s in pool.kv_sources), default=0),
                "telemetry_age_s": round(min(ages), 3) if ages else None,
                # The KV view alone: past --kv-max-age the pool's cached blocks count as none, however
                # fresh its load reports (telemetry_age_s is the youngest of the three signals).
                "kv_age_s": round(now - pool.kv_at, 3) if pool.kv_at is not None else None,
                "kv_fresh": pool.kv_fresh(now, limits),
                "pending_requests": pool.pending_requests,
            }
        )
    events = getattr(core, "events", None)
    recent = [e.as_dict() for e in events.latest(100)] if events is not None else []
    decisions = [e for e in recent if e["kind"] == "decision"][:30]
    return {
        "frontend_id": frontend_id,
        "time": time.time(),
        "regions": [{"region": r, "pools": pools} for r, pools in sorted(regions.items())],
        "decisions": decisions,
        "cached_prefix": cached_prefix(decisions),
        "migrations": [e for e in recent if e["kind"] == "migration"][:20],
        "refusals": [e for e in recent if e["kind"] == "refusal"][:20],
        # per tenant and priority class (metrics.FlowStats): requests, tokens, the dispatch queue
        # now and its recent wait, sheds, budget refusals and what the last admission left
        "flow": [f for f in core.metrics.flow.snapshot() if tenant is None or f["tenant"] == tenant],
    }


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>Global Router status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1f24;background:#fafbfc}
h1{font-size:20px;margin:0 0 .2em}h2{font-size:16px;margin:1.4em 0 .4em}h3{font-size:14px;margin:1em 0 .3em;color:#444}
table{border-collapse:collapse;background:#fff;min-width:50%}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;white-space:nowrap}
th{background:#eef1f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.state{font-weight:600;padding:0 6px;border-radius:3px}
.ready{background:#d8f5dc;color:#116329}.draining{background:#fff1c2;color:#7a4d00}
.stale{background:#eee;color:#555}.not-ready{background:#ffd8d3;color:#8c1d18}
.stale-kv{color:#8c1d18}#prefix{color:#57606a;margin-bottom:.4em}
#meta{color:#57606a}.empty{color:#8c959f;font-style:italic}
</style></head>
<body>
<h1>Global Router</h1>
<div id="meta">loading…</div>
<h2>Pools</h2><div id="pools"></div>
<h2>Tenants and priority classes</h2><div id="flow"></div>
<h2>Recent decisions</h2><div id="prefix"></div><div id="decisions"></div>
<h2>Migrations</h2><div id="migrations"></div>
<h2>Refusals</h2><div id="refusals"></div>
<script>
"use strict";
const REFRESH_MS = 1000;
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c === null || c === undefined ? "–" : String(c));
  return e;
}
function table(headers, rows) {
  if (!rows.length) return el("div", {class: "empty"}, "none yet");
  const t = el("table");
  const head = el("tr");
  head.append(...headers.map(h => el("th", {}, h)));
  t.append(head);
  for (const r of rows) {
    const tr = el("tr");
    for (const cell of r) tr.append(cell instanceof Node ? wrap(cell) : el("td", typeof cell === "number" ? {class: "num"} : {}, cell));
    t.append(tr);
  }
  return t;
}
function wrap(node) { const td = el("td"); td.append(node); return td; }
function clock(wall) { return new Date(wall * 1000).toLocaleTimeString(); }
function share(e) { return e.prompt_blocks ? Math.round(100 * e.cached_blocks / e.prompt_blocks) + "%" : "–"; }
function pct(x) { return x === null || x === undefined ? "–" : Math.round(100 * x) + "%"; }
function age(x) { return x === null ? null : x.toFixed(1) + " s"; }
function secs(x) { return x === null || x === undefined ? null : (x < 1 ? Math.round(1000 * x) + " ms" : x.toFixed(2) + " s"); }
function counts(o) { const k = Object.keys(o).sort(); return k.length ? k.map(r => r + " " + o[r]).join(", ") : "0"; }
function budget(b) {
  return b.length ? b.map(q => q.limit + ": " + q.remaining + " / " + q.max + " (resets in " + q.resets_in_s + " s)").join("; ") : "–";
}
function render(s) {
  document.getElementById("meta").textContent =
    "frontend " + s.frontend_id + " · updated " + clock(s.time);
  const pools = document.getElementById("pools");
  pools.replaceChildren();
  if (!s.regions.length) pools.append(el("div", {class: "empty"}, "no pool listed"));
  for (const region of s.regions) {
    pools.append(el("h3", {}, "region " + region.region));
    pools.append(table(
      ["pool", "model", "state", "running", "waiting", "KV blocks used / total", "indexed blocks", "KV view age", "telemetry age"],
      region.pools.map(p => [
        p.pool_id, p.adapters.length ? p.model + " + adapters " + p.adapters.join(", ") : p.model, el("span", {class: "state " + p.state, "data-pool": p.pool_id}, p.state +
          (p.directory_state === "lease_lapsed" ? " (lease lapsed, telemetry live: " + age(p.lease_grace_left_s) + " of grace left)" : "")),
        p.requests_running, p.requests_waiting,
        p.kv_blocks_used === null ? null : p.kv_blocks_used + " / " + p.kv_blocks_total,
        p.indexed_blocks, el("span", {class: p.kv_fresh ? "" : "stale-kv", "data-kv-pool": p.pool_id},
          p.kv_age_s === null ? "no KV yet" : age(p.kv_age_s) + (p.kv_fresh ? "" : " (stale: counts as uncached)")),
        age(p.telemetry_age_s)])));
  }
  document.getElementById("flow").replaceChildren(table(
    ["class", "tenant", "requests", "tokens", "queued now", "queue p50", "queue p99", "queue mean", "shed", "budget refusals", "budget left (last admission)"],
    s.flow.map(f => [f.class, el("span", {"data-tenant": f.tenant, "data-class": f.class}, f.tenant), f.requests, f.tokens, f.queued,
                     secs(f.queue_p50_s), secs(f.queue_p99_s), secs(f.queue_mean_s), counts(f.sheds),
                     counts(f.budget_refusals), budget(f.budget)])));
  const q = s.cached_prefix;
  document.getElementById("prefix").textContent = q.decisions
    ? "cached prefix over the last " + q.decisions + " decisions: achieved " + pct(q.achieved_mean) +
      " of the prompt on average, available " + pct(q.available_mean) + " at the best-cached eligible pool; " +
      q.gave_up + " gave some of it up"
    : "";
  document.getElementById("decisions").replaceChildren(table(
    ["time", "request", "model", "pool", "cached share (pool)", "achieved (index)", "available (index)"],
    s.decisions.map(e => [clock(e.wall), e.request_id, e.model, e.pool_id, share(e),
                          pct(e.achieved_share), pct(e.available_share)])));
  document.getElementById("migrations").replaceChildren(table(["time", "request", "left pool", "why"],
    s.migrations.map(e => [clock(e.wall), e.request_id, e.pool_id, e.detail])));
  document.getElementById("refusals").replaceChildren(table(["time", "request", "pool", "reason"],
    s.refusals.map(e => [clock(e.wall), e.request_id, e.pool_id, e.detail])));
}
async function refresh() {
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    if (r.ok) render(await r.json());
    else document.getElementById("meta").textContent = "status unavailable: HTTP " + r.status;
  } catch (err) {
    document.getElementById("meta").textContent = "status unavailable: " + err;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}
refresh();
</script>
</body></html>
"""
