"""Reads an engine's load from its Prometheus text (`GET /metrics`), per engine kind (pure).

Gauges are summed over their label sets (one server may host several engines, e.g. data-parallel
ranks under one API server). A gauge the text lacks is unknown and reads as 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from meshkit.validation import Violations, check_identifier

# Bound on the text the relay parses (outside input).
MAX_METRICS_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class MetricNames:
    """Which samples carry what, for one engine kind (names without the Prometheus suffixes)."""

    running: str
    waiting: str
    kv_usage: str
    """A 0..1 fraction of the KV cache in use."""
    kv_blocks_total: tuple[str, str]
    """(info gauge, label) that states the KV blocks the engine holds."""
    prefix_hits: str
    prefix_queries: str


VLLM = MetricNames(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_usage="vllm:kv_cache_usage_perc",
    kv_blocks_total=("vllm:cache_config_info", "num_gpu_blocks"),
    prefix_hits="vllm:prefix_cache_hits",
    prefix_queries="vllm:prefix_cache_queries",
)
SGLANG = MetricNames(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_usage="sglang:token_usage",
    kv_blocks_total=("sglang:cache_config_info", "max_total_num_tokens"),
    prefix_hits="sglang:cached_tokens",
    prefix_queries="sglang:prompt_tokens",
)
NAMES = {"vllm": VLLM, "sglang": SGLANG}


@dataclass(frozen=True)
class EngineLoad:
    """One engine server's load as its metrics state it."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_total: int = 0
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    process_start: float = 0.0
    """process_start_time_seconds: a change means the engine restarted."""

    @property
    def kv_blocks_used(self) -> int:
        return round(self.kv_usage * self.kv_blocks_total)


def parse_load(text: str, names: MetricNames) -> EngineLoad:
    """The load in one /metrics text; raises ValueError when the text is not Prometheus text."""
    sums: dict[str, float] = {}
    blocks_total = 0
    start = 0.0
    info_name, info_label = names.kv_blocks_total
    wanted = {names.running, names.waiting, names.kv_usage, names.prefix_hits, names.prefix_queries}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            base = name.removesuffix("_total")
            if name in wanted or base in wanted:
                key = name if name in wanted else base
                sums[key] = sums.get(key, 0.0) + float(sample.value)
            elif name.startswith(info_name) and info_label in sample.labels:
                try:
                    blocks_total += int(float(sample.labels[info_label]))
                except ValueError:
                    pass
            elif name == "process_start_time_seconds":
                start = float(sample.value)
    return EngineLoad(
        running=int(sums.get(names.running, 0)),
        waiting=int(sums.get(names.waiting, 0)),
        kv_usage=min(max(sums.get(names.kv_usage, 0.0), 0.0), 1.0),
        kv_blocks_total=blocks_total,
        prefix_hits=sums.get(names.prefix_hits, 0.0),
        prefix_queries=sums.get(names.prefix_queries, 0.0),
        process_start=start,
    )


MAX_ADAPTERS_PER_MODEL = 256
"""Adapters the relay reports per model (outside input; vLLM's --max-loras is far below)."""


@dataclass(frozen=True)
class ModelList:
    """What `GET /v1/models` lists: base models, and the LoRA adapters served on each."""

    models: list[str]
    """Base model ids, sorted."""
    adapters: dict[str, list[str]]
    """Base model id -> its adapters' ids, sorted (only models that have some)."""


def parse_model_list(body: object) -> ModelList:
    """Models and adapters from a `GET /v1/models` body (OpenAI list form); raises ValueError
    otherwise. vLLM lists each LoRA adapter as an entry of its own whose `parent` names its base
    model (`root` is the adapter's path); an adapter whose name is not a valid id (the mesh's id
    rules) is left out, as are adapters past MAX_ADAPTERS_PER_MODEL of one model."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise ValueError("a model list must be an object with a data list")
    models: set[str] = set()
    adapters: dict[str, set[str]] = {}
    for entry in body["data"][:1000]:
        if not (isinstance(entry, dict) and isinstance(entry.get("id"), str) and entry["id"]):
            continue
        name = entry["id"]
        parent = entry.get("parent")
        if isinstance(parent, str) and parent and parent != name:
            if _valid_id(name) and _valid_id(parent):
                served = adapters.setdefault(parent, set())
                if len(served) < MAX_ADAPTERS_PER_MODEL:
                    served.add(name)
            continue
        models.add(name[:128])
    return ModelList(sorted(models), {m: sorted(a) for m, a in sorted(adapters.items())})


def _valid_id(value: str) -> bool:
    v = Violations()
    check_identifier(v, "id", value)
    return not v


def parse_models(body: object) -> list[str]:
    """Base model ids from a `GET /v1/models` body (LoRA adapters left out); raises ValueError otherwise."""
    return parse_model_list(body).models
