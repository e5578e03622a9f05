"""Routing quality on real multi-turn chat: the Mooncake conversation trace (first half).

8 pools x 4,000 blocks at R = 6,000 work tokens/s per pool (issue 13): every policy; dynamo over
tie-break seeds; the share-of-ideal / p99-wait frontier of the default's cost as its prefill
weight and hotspot term vary; the default under a wait SLO (`--wait-slo`) set from dynamo's
p99 of the same run; and a perfect-information bound: the same greedy cost (weighted prefill
left + wait) computed from the simulated pools' true caches and queues, which no frontend can
see. The synthetic trace at R = 12,000 is the check that the default holds elsewhere. Plot
(bench/results/): quality_conversation_frontier.png.

    .venv/bin/python bench/bench_conversation.py [--trace FILE] [--synthetic FILE]
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from globalrouter.policies import POLICIES, Choice, FrontendView
from globalrouter.selection import SelectionConfig
from globalrouter.simulate import SimConfig, SimPool, SimResult, simulate
from globalrouter.trace import TRACE_BLOCK_SIZE, TraceRequest, load_trace
from globalrouter.wait_slo import WaitSlo

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TRACES = ROOT.parent / "shared" / "traces"
RATE = 6_000
SEEDS = (0, 1, 2, 3, 4)
FRONTIER = [(pw, hs) for pw in (1.3, 2.0, 3.0, 5.0) for hs in (0.25, 0.0)]
"""(prefill_weight, hotspot_seconds) of the default's cost; (1.3, 0.25) is the shipped default."""
ORACLE_WEIGHTS = (1.0, 1.5, 1.75, 2.0, 2.5, 3.0, 5.0)
ORACLE_TAIL = ((3.0, 2.0, 1.0), (3.0, 3.0, 1.0), (5.0, 3.0, 4.0), (5.0, 4.0, 4.0), (5.0, 4.0, 2.0))
"""(weight, knee seconds, excess weight) of the perfect-information greedy with a convex wait cost."""


class TrueStateGreedy:
    """The bound: lowest weight * (prompt tokens the pool lacks) / R + the pool's true wait, read
    from the simulated pools (their LRU contents and when they free up), not from reports."""

    def __init__(self, sims: list[SimPool], weight: float, knee: float = 0.0, excess: float = 0.0) -> None:
        self.sims = sims
        self.weight = weight
        self.knee = knee
        """With `excess`, a wait beyond `knee` seconds costs `1 + excess` per second (convex)."""
        self.excess = excess

    def choose(self, view: FrontendView, request: TraceRequest, now: float) -> Choice:
        best = (float("inf"), 0, 0)
        for k, sim in enumerate(self.sims):
            left = max(0, request.input_length - TRACE_BLOCK_SIZE * sim.cache.prefix_hit(request.hash_ids))
            wait = max(0.0, sim.free_at - now)
            cost = self.weight * left / sim.rate + wait + self.excess * max(0.0, wait - self.knee)
            if cost < best[0]:
                best = (cost, k, left)
        return Choice(best[1], best[2])


def fmt(r: SimResult) -> str:
    return f"{r.share_of_ideal:.4f} | {r.wait_p50:.3f} | {r.wait_p99:.3f} | {r.imbalance:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", default=str(TRACES / "mooncake_conversation_first_half.jsonl"))
    parser.add_argument("--synthetic", default=str(TRACES / "mooncake_synthetic_trace.jsonl"))
    args = parser.parse_args()
    started = time.monotonic()
    conv = load_trace(args.trace)
    config = SimConfig(pools=8, capacity_blocks=4000, rate=RATE)
    policies = {name: simulate(conv, config, name) for name in POLICIES}
    for r in policies.values():
        print(f"{r.policy:<13} share={r.share_of_ideal:.4f} p99={r.wait_p99:.3f}", flush=True)
    dynamo = [policies["dynamo"]] + [
        simulate(conv, SimConfig(pools=8, capacity_blocks=4000, rate=RATE, seed=s), "dynamo")
        for s in SEEDS[1:]
    ]
    d_share = [r.share_of_ideal for r in dynamo]
    d_p99 = [r.wait_p99 for r in dynamo]
    print(
        f"dynamo seeds: share {statistics.mean(d_share):.4f}±{statistics.pstdev(d_share):.4f} "
        f"p99 {statistics.mean(d_p99):.3f}±{statistics.pstdev(d_p99):.3f}",
        flush=True,
    )
    frontier = []
    for pw, hs in FRONTIER:
        r = simulate(conv, config, "default", SelectionConfig(prefill_weight=pw, hotspot_seconds=hs))
        frontier.append((pw, hs, r))
        print(
            f"prefill_weight {pw} hotspot {hs}: share={r.share_of_ideal:.4f} p99={r.wait_p99:.3f}", flush=True
        )
    dyn_p99 = policies["dynamo"].wait_p99
    slo = {
        target: simulate(conv, config, "default", SelectionConfig(wait_slo=WaitSlo(target)))
        for target in (round(dyn_p99 * 0.85, 3), round(dyn_p99, 3))
    }
    for target, r in slo.items():
        print(f"wait slo {target}: share={r.share_of_ideal:.4f} p99={r.wait_p99:.3f}", flush=True)
    oracle = []
    for w in ORACLE_WEIGHTS:
        r = simulate(conv, config, "true_state", omniscient=functools.partial(TrueStateGreedy, weight=w))
        oracle.append((w, r))
        print(f"true-state greedy w={w}: share={r.share_of_ideal:.4f} p99={r.wait_p99:.3f}", flush=True)
    oracle_tail = []
    for w, knee, excess in ORACLE_TAIL:
        r = simulate(
            conv,
            config,
            "true_state",
            omniscient=functools.partial(TrueStateGreedy, weight=w, knee=knee, excess=excess),
        )
        oracle_tail.append((w, knee, excess, r))
        print(
            f"true-state greedy w={w} knee={knee} excess={excess}: share={r.share_of_ideal:.4f} p99={r.wait_p99:.3f}"
        )
    syn = load_trace(args.synthetic)
    syn_config = SimConfig(pools=8, capacity_blocks=4000, rate=12_000)
    syn_rows = {name: simulate(syn, syn_config, name) for name in ("default", "dynamo")}
    syn_target = round(syn_rows["dynamo"].wait_p99, 3)
    syn_rows[f"default, --wait-slo {syn_target}"] = simulate(
        syn, syn_config, "default", SelectionConfig(wait_slo=WaitSlo(syn_target))
    )

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(
        [r.wait_p99 for *_, r in frontier], [r.share_of_ideal for *_, r in frontier], label="default's cost"
    )
    for pw, hs, r in frontier:
        ax.annotate(f"{pw}/{hs}", (r.wait_p99, r.share_of_ideal), fontsize=7)
    ax.scatter(d_p99, d_share, marker="x", color="red", label="dynamo (5 seeds)")
    ax.scatter(
        [r.wait_p99 for r in slo.values()],
        [r.share_of_ideal for r in slo.values()],
        marker="s",
        color="green",
        label="default, --wait-slo",
    )
    ax.plot(
        [r.wait_p99 for _, r in oracle],
        [r.share_of_ideal for _, r in oracle],
        color="grey",
        marker=".",
        label="perfect-information greedy (bound)",
    )
    ax.axhline(0.95, color="grey", linestyle="--", linewidth=0.8)
    ax.axvline(policies["dynamo"].wait_p99, color="red", linestyle=":", linewidth=0.8)
    ax.set_xlabel("wait p99 (s)")
    ax.set_ylabel("share of ideal hit rate")
    ax.set_title(f"conversation trace, 8 x 4,000 blocks, R = {RATE:,}: prefill weight / hotspot floor")
    ax.legend()
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    plot = "quality_conversation_frontier.png"
    fig.savefig(RESULTS / plot, dpi=110)
    plt.close(fig)

    default, dyn = policies["default"], policies["dynamo"]
    best = max((r for *_, r in frontier if r.wait_p99 <= dyn.wait_p99), key=lambda r: r.share_of_ideal)
    within = [r for _, r in oracle if r.wait_p99 <= dyn.wait_p99]
    within_tail = [r for *_, r in oracle_tail if r.wait_p99 <= dyn.wait_p99]
    bound_tail = max(within_tail, key=lambda r: r.share_of_ideal) if within_tail else None
    bound = max(within, key=lambda r: r.share_of_ideal) if within else None
    shipped = [default, *slo.values()]
    met = any(r.share_of_ideal >= 0.95 and r.wait_p99 <= dyn.wait_p99 for r in shipped)
    lines = [
        "## Routing quality on the conversation trace (`bench_conversation`)",
        "",
        f"Command: `.venv/bin/python bench/bench_conversation.py` (trace `{Path(args.trace).name}`, "
        f"{len(conv):,} requests; 8 pools x 4,000 blocks, R = {RATE:,} work tokens/s per pool); machine: "
        f"{platform.machine()}, Python {platform.python_version()}; ran {time.monotonic() - started:.0f}s.",
        "",
        "| policy | share_of_ideal | wait_p50 (s) | wait_p99 (s) | imbalance |",
        "|---|---:|---:|---:|---:|",
        *[f"| {name} | {fmt(r)} |" for name, r in policies.items()],
        "",
        f"Dynamo over tie-break seeds {', '.join(map(str, SEEDS))}: share {statistics.mean(d_share):.4f} ± "
        f"{statistics.pstdev(d_share):.4f}, p99 {statistics.mean(d_p99):.3f} ± {statistics.pstdev(d_p99):.3f} s.",
        "",
        f"**Goal: share_of_ideal ≥ 0.95 with wait_p99 ≤ dynamo's ({dyn.wait_p99:.3f} s): "
        f"{'met' if met else 'not met'}.** The default "
        f"reaches {default.share_of_ideal:.4f} at {default.wait_p99:.3f} s (dynamo {dyn.share_of_ideal:.4f}). "
        "The frontier below is the default's cost with other weights, same run:",
        "",
        "| prefill_weight | hotspot_seconds | share_of_ideal | wait_p50 (s) | wait_p99 (s) | imbalance |",
        "|---:|---:|---:|---:|---:|---:|",
        *[f"| {pw} | {hs} | {fmt(r)} |" for pw, hs, r in frontier],
        "",
        f"Best share with p99 no worse than dynamo on this frontier: {best.share_of_ideal:.4f}. Share rises "
        "with the prefill weight and so does the tail: every point that keeps a session on the pool "
        "holding its prefix more often queues more of the next turns behind it.",
        "",
        "The default under a wait SLO (`globalrouter serve --wait-slo SECONDS`, quantile 0.99: "
        "prefill weight 5, plus a price per second of estimated wait beyond the target, raised or "
        "lowered online so that the wait the frontend estimates at its pick exceeds the target on "
        "1% of decisions), targets set from dynamo's p99 in this run:",
        "",
        "| --wait-slo (s) | share_of_ideal | wait_p50 (s) | wait_p99 (s) | imbalance |",
        "|---:|---:|---:|---:|---:|",
        *[f"| {target} | {fmt(r)} |" for target, r in slo.items()],
        "",
        "The bound: the same greedy cost (weight x prompt tokens the pool lacks / R + wait) computed "
        "from the simulated pools' true caches and queues (no report delay, no estimate), per weight:",
        "",
        "| weight | share_of_ideal | wait_p50 (s) | wait_p99 (s) | imbalance |",
        "|---:|---:|---:|---:|---:|",
        *[f"| {w} | {fmt(r)} |" for w, r in oracle],
        "",
        (
            f"With perfect information the best greedy point with p99 no worse than dynamo reaches "
            f"{bound.share_of_ideal:.4f}"
            if bound
            else "With perfect information no greedy point keeps p99 within dynamo's"
        )
        + ": the tail is set by the pool model (each pool serves first come first served, and a "
        "session's next turn waits behind whatever its holder is serving, up to tens of seconds for "
        "the trace's longest prompts), so the choice per request is between that wait and a second "
        "copy of a long prefix. What decides the figure is that trade, not the frontend's information.",
        "",
        "A convex wait cost moves that trade (a wait beyond the knee costs 1 + excess per second, so "
        "affinity stays strong until a queue nears the tail), still with perfect information:",
        "",
        "| weight | knee (s) | excess | share_of_ideal | wait_p50 (s) | wait_p99 (s) | imbalance |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *[f"| {w} | {knee} | {excess} | {fmt(r)} |" for w, knee, excess, r in oracle_tail],
        "",
        (
            f"Best of these with p99 no worse than dynamo: {bound_tail.share_of_ideal:.4f}."
            if bound_tail
            else "None of these keeps p99 within dynamo's."
        ),
        "",
        "Synthetic trace, 8 x 4,000, R = 12,000 (the check elsewhere): "
        + "; ".join(f"{n} share {r.share_of_ideal:.4f}, p99 {r.wait_p99:.3f} s" for n, r in syn_rows.items())
        + ".",
        "",
        f"Plot: [{plot}](bench/results/{plot})",
        "",
    ]
    (RESULTS / "bench_conversation.md").write_text("\n".join(lines))
    print(f"wrote {RESULTS / 'bench_conversation.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
