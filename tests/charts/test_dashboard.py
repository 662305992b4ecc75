"""The Grafana dashboard queries what a real gemma_server exports, and every query is valid PromQL.

A real `python -m gemma_server` (the image's entrypoint; the engine `make setup` installed) serves the tiny
chat checkpoint; the openai SDK sends real traffic (chat and completions, streamed and not); /metrics is
scraped. Every expression of the dashboard (panel targets and the model variable's metric) is
interpolated as Grafana would and parsed by Prometheus's own parser (tests/charts/promql, a Go program
over github.com/prometheus/prometheus/promql/parser, built once into the cache). From the parsed AST:

- every selected metric is in the scrape, and its label matchers select at least one exported series;
- every `by (...)` label is on the aggregated metric, or is one the scrape adds (pod, namespace, ...);
- the histograms and counters the panels read moved with the traffic (the panels would show data).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.checkpoints.fixtures import chat_checkpoint  # noqa: F401 - the session fixture, used below

from .conftest import CHART, ROOT
from .promql_check import parse_promql, promql_check, selects  # noqa: F401 - promql_check: the fixture

DASHBOARD = CHART / "dashboards" / "gemma-rust-server.json"
# A served name with regex metacharacters, like real ones (org/name, dots), to exercise the escaping.
MODEL = "org/gemma-4-E2B-it.q4"
# Labels Prometheus adds at scrape time (GMP PodMonitoring and Prometheus Operator targets carry these).
TARGET_LABELS = {"pod", "namespace", "instance", "job", "container", "node", "cluster", "location"}
# Series of kube-state-metrics rather than of the server, and their labels (kubernetes/kube-state-metrics
# docs/metrics/workload/horizontalpodautoscaler-metrics.md; GKE Managed Prometheus's kube state metrics
# package exports the same): the replicas an HPA wants, for the autoscaling row.
KUBE_STATE_METRICS = {"kube_horizontalpodautoscaler_status_desired_replicas": {"namespace", "horizontalpodautoscaler"}}
# GKE system metrics as Managed Service for Prometheus serves them to PromQL: Cloud Monitoring's
# kubernetes.io/container/accelerator/{duty_cycle,memory_used,memory_total} become
# kubernetes_io:container_accelerator_*, labelled with the k8s_container resource's labels (project_id,
# location, cluster_name, namespace_name, pod_name, container_name), the metric's own (make, model,
# accelerator_id) and monitored_resource. Not exported by the server: checked by their labels only.
GKE_RESOURCE_LABELS = {"project_id", "location", "cluster_name", "namespace_name", "pod_name", "container_name",
                       "monitored_resource", "make", "model", "accelerator_id"}
GKE_SYSTEM_METRICS = {f"kubernetes_io:container_accelerator_{m}": GKE_RESOURCE_LABELS
                      for m in ("duty_cycle", "memory_used", "memory_total")}
# Series the panels read from elsewhere than the server, with their labels.
EXTERNAL_METRICS = {**KUBE_STATE_METRICS, **GKE_SYSTEM_METRICS}
# Grafana's own variables, interpolated as Grafana does before a query reaches Prometheus.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h"}


# ------------------------------------------------------------------------------------------- PromQL parser


def test_promql_checker_rejects_what_prometheus_rejects(promql_check):
    good, bad, unknown_fn = parse_promql(promql_check, [
        'histogram_quantile(0.9, sum by (le) (rate(x_bucket{a=~"b"}[1m])))',
        "rate(x[1m]",
        "rated(x[1m])",
    ])
    assert good["error"] == "" and good["groupings"] == [{"by": ["le"], "metrics": ["x_bucket"]}]
    assert "unclosed left parenthesis" in bad["error"]
    assert "unknown function" in unknown_fn["error"]


# ------------------------------------------------------------------------------------------- the dashboard


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def grafana_regex_escape(value: str) -> str:
    """Grafana's Prometheus data source escaping of a multi-value variable inside a regex matcher
    (prometheusSpecialRegexEscape): regex metacharacters get a double backslash, i.e. a backslash that
    survives the PromQL string literal."""
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value)


def interpolate(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    # The model variable (multi-value, regex matcher): Grafana substitutes the escaped value.
    expr = expr.replace("$model", grafana_regex_escape(MODEL))
    # What is left of "$" may only be label_replace's group references ("$1"), which Grafana leaves alone.
    assert not re.search(r"\$(?!\d)", expr), f"uninterpolated variable in {expr!r}"
    return expr


def queries(d: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and the model variable's metric."""
    out = [(f"panel {p['title']!r}", interpolate(t["expr"]))
           for p in all_panels(d) for t in p.get("targets", [])]
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"]["query"])
            assert m, f"variable {var['name']}: unexpected query {var['query']}"
            out.append((f"variable {var['name']}", f'{m.group(1)}{{{m.group(2)}!=""}}'))
    return out


def test_dashboard_has_the_panels_an_on_call_engineer_needs():
    titles = {p["title"] for p in all_panels(dashboard()) if p["type"] != "row"}
    assert {"Request rate", "Time to first token", "Inter-token latency", "End-to-end latency", "Tokens/s",
            "Running and waiting requests", "Finish reasons", "Boot stage seconds", "Build info",
            "Readiness per pod", "Replicas and desired replicas", "Autoscaling metric per pod",
            "Prefix cache hit rate", "Speculative decoding", "TPU duty cycle per pod", "TPU HBM used per pod"} <= titles
    ttft = next(p for p in all_panels(dashboard()) if p["title"] == "Time to first token")
    assert {t["legendFormat"] for t in ttft["targets"]} >= {"p50", "p95", "p99"}
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["model"]["multi"] and variables["model"]["includeAll"]
    for p in all_panels(dashboard()):
        for t in p.get("targets", []):
            assert 'model_name=~"$model"' in t["expr"], f"{p['title']}: {t['expr']} ignores the model variable"
            assert t["datasource"]["uid"] == "${datasource}"


def test_the_tpu_panels_read_the_container_that_declares_gkes_tpu_metrics_port():
    """GKE exports kubernetes.io/container/accelerator/* only for a TPU container that declares containerPort
    8431; the TPU panels select the series of one container by name: the server's, which declares it in the
    Deployment the operator builds for a TPU server (and not for a CPU one, which has no TPU to report)."""
    from gemma_operator.builders.deployment import CONTAINER, build_deployment
    from gemma_operator.builders.ownership import Meta
    from gemma_operator.spec import TPU_METRICS_PORT, parse_spec

    tpu_exprs = [expr for _, expr in queries(dashboard()) if "container_accelerator_" in expr]
    assert len(tpu_exprs) == 3
    for expr in tpu_exprs:
        selected = re.findall(r'kubernetes_io:container_accelerator_\w+\{([^}]*)\}', expr)
        assert selected and all(f'container_name="{CONTAINER}"' in labels for labels in selected), expr
    meta = Meta("g", "ns", "u")

    def ports(accelerator: dict) -> dict[str, int]:
        spec = parse_spec({"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": accelerator})
        (container,) = [c for c in build_deployment(spec, meta)["spec"]["template"]["spec"]["containers"]
                        if c["name"] == CONTAINER]
        return {p["name"]: p["containerPort"] for p in container["ports"]}

    assert ports({"type": "tpu-v5-lite-podslice", "topology": "2x2"})["tpu-metrics"] == TPU_METRICS_PORT == 8431
    assert ports({"type": "tpu-v6e-slice"})["tpu-metrics"] == 8431
    assert "tpu-metrics" not in ports({"type": "cpu"})


def test_dashboard_ids_and_grid_are_consistent():
    panels = all_panels(dashboard())
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, f"{p['title']} is wider than the grid"


# ------------------------------------------------------------------------------------------- a real server


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(base: str) -> dict[str, list]:
    """metric sample name -> [(labels, value)] from /metrics."""
    out: dict[str, list] = {}
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@pytest.fixture(scope="module")
def traffic_scrape(chat_checkpoint, tmp_path_factory):  # noqa: F811
    """Start `python -m gemma_server`, send real traffic with the openai SDK, return the /metrics samples."""
    from openai import OpenAI

    port = free_port()
    d = tmp_path_factory.mktemp("dashboard-server")
    log = d / "server.log"
    cmd = [sys.executable, "-m", "gemma_server", "--use-installed-engine", "--host", "127.0.0.1",
           "--port", str(port), "--termination-log", str(d / "termination.log")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GEMMA_MODEL": str(chat_checkpoint), "GEMMA_CONTEXT": "1024",
           "GEMMA_DTYPE": "float32", "GEMMA_SERVED_MODEL_NAME": MODEL, "GEMMA_READ_EVERY": "2",
           # Prompt lookup, so the speculative decoding panel has data (a fixed limit: the one measured at warmup
           # may turn it off on this CPU).
           "GEMMA_SPECULATIVE_METHOD": "ngram", "GEMMA_NUM_SPECULATIVE_TOKENS": "4",
           "GEMMA_SPECULATIVE_MAX_BATCH": "1"}
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server not ready in 300s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        hello = [{"role": "user", "content": "Hello there"}]
        reply = client.chat.completions.create(model=MODEL, messages=hello, max_tokens=8)
        # The next turn of that chat reads only its new part: the prefix cache's hits move.
        client.chat.completions.create(model=MODEL, max_tokens=8, messages=[
            *hello, {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "And then?"}])
        for chunk in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Count to five"}], max_tokens=12,
                stream=True, stream_options={"include_usage": True}):
            pass
        client.completions.create(model=MODEL, prompt="The ocean is", max_tokens=6)
        # A greedy completion of which prompt lookup's drafts keep six on the chat checkpoint (its tokens are those
        # without speculation, so what it keeps is fixed): the accepted counters move.
        client.completions.create(model=MODEL, prompt="ocean world ocean world ocean world", max_tokens=64,
                                  temperature=0)
        for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, stream=True):
            pass
        yield scrape(base)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_every_dashboard_query_parses_and_reads_series_the_server_exports(promql_check, traffic_scrape):
    where_exprs = queries(dashboard())
    results = parse_promql(promql_check, [e for _, e in where_exprs])
    problems = []
    for (where, expr), r in zip(where_exprs, results):
        if r["error"]:
            problems.append(f"{where}: {expr}: {r['error']}")
            continue
        assert r["selectors"], f"{where}: {expr} selects nothing"
        for sel in r["selectors"]:
            if sel["metric"] in EXTERNAL_METRICS:
                unknown = {m["name"] for m in sel["matchers"]} - EXTERNAL_METRICS[sel["metric"]] - {"__name__"}
                if unknown:
                    problems.append(f"{where}: {sel['metric']} has no labels {sorted(unknown)}")
                continue
            samples = traffic_scrape.get(sel["metric"])
            if not samples:
                problems.append(f"{where}: {sel['metric']} is not exported")
            elif not any(selects(sel["matchers"], labels) for labels, _ in samples):
                problems.append(f"{where}: {sel['metric']}{sel['matchers']} matches no exported series")
        for g in r["groupings"]:
            for metric in g["metrics"]:
                if metric in EXTERNAL_METRICS:
                    if set(g["by"]) - EXTERNAL_METRICS[metric]:
                        problems.append(f"{where}: by {sorted(set(g['by']) - EXTERNAL_METRICS[metric])} not on {metric}")
                    continue
                exported = set().union(*(labels.keys() for labels, _ in traffic_scrape.get(metric, [({}, 0)])))
                missing = set(g["by"]) - exported - TARGET_LABELS
                if missing:
                    problems.append(f"{where}: by {sorted(missing)} not on {metric}")
    assert not problems, "\n".join(problems)


def test_traffic_moved_every_series_the_panels_plot(promql_check, traffic_scrape):
    names = {sel["metric"] for r in parse_promql(promql_check, [e for _, e in queries(dashboard())])
             for sel in r["selectors"]}
    mine = lambda name: [v for labels, v in traffic_scrape[name] if labels.get("model_name") == MODEL]  # noqa: E731
    for name in sorted(names - set(EXTERNAL_METRICS)):
        if name.endswith(("_bucket", "_sum", "_count")):
            base = name.rsplit("_", 1)[0]
            assert sum(mine(f"{base}_count")) > 0, f"{base}: no observations after traffic"
        elif name.endswith("_total"):
            assert sum(mine(name)) > 0, f"{name}: still 0 after traffic"
    assert mine("gemma_engine_ready") == [1.0]
    stages = {labels["stage"]: v for labels, v in traffic_scrape["gemma_boot_stage_seconds"]}
    assert stages["weights"] > 0 and stages["warmup"] > 0, stages
    (info,) = traffic_scrape["gemma_build_info"]
    assert {"torch", "rustc", "python", "crate", "device", "torch_tpu"} <= info[0].keys() and info[1] == 1
    reasons = {labels["finished_reason"] for labels, _ in traffic_scrape["gemma_request_success_total"]}
    assert reasons == {"stop", "length", "abort", "error"}
