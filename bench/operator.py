"""Operator benchmark on the local control plane (tests/cluster/): how fast a GemmaRustServer gets its children.

    .venv/bin/python -m bench.operator [--latency-crs 50] [--burst-crs 100]

Measures, with the operator running as a real `python -m gemma_operator` process:
1. latency: one CR at a time, time from the create call returning to its Deployment being readable;
   p50 / p95 over --latency-crs CRs;
2. burst: --burst-crs CRs created back to back, time until every one has its Deployment and Service;
   compared, in the same run, with the floor: the bench itself server-side applying the same 2 x N
   objects directly, one after another, before the operator starts; the ratio says what the operator adds;
3. the operator process's peak resident memory (VmHWM) over the whole run.
Pods run on the CPU node (accelerator cpu) so TPU capacity does not limit the burst; kwok makes them Ready.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gemma_operator.builders.deployment import build_deployment
from gemma_operator.builders.ownership import Meta
from gemma_operator.builders.service import build_service
from gemma_operator.kube import ApiError, Kube
from gemma_operator.spec import parse_spec
from tests.cluster.controlplane import ControlPlane
from tests.cluster.plugin import Cluster
from tests.operator.harness import install_crd, least_privilege_kubeconfig, start_operator, stop_operator

GRS = "/apis/gemmarust.dev/v1alpha1/namespaces/{ns}/gemmarustservers"
SPEC = {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"},
        "monitoring": {"podMonitoring": False}}


def make_ns(kube: Kube, name: str) -> str:
    kube.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def create_cr(kube: Kube, ns: str, name: str) -> None:
    kube.request("POST", GRS.format(ns=ns), {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
                                             "metadata": {"name": name}, "spec": SPEC})


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latency(kube: Kube, n: int) -> list[float]:
    ns = make_ns(kube, "bench-latency")
    out = []
    for i in range(n):
        name = f"lat-{i}"
        create_cr(kube, ns, name)
        t0 = time.perf_counter()
        while True:
            try:
                kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")
                break
            except ApiError as e:
                if e.status != 404:
                    raise
            if time.perf_counter() - t0 > 60:
                raise RuntimeError(f"no Deployment for {name} after 60s")
            time.sleep(0.005)
        out.append(time.perf_counter() - t0)
    return out


def wait_children(kube: Kube, ns: str, n: int, timeout: float = 300.0) -> float:
    t0 = time.perf_counter()
    while True:
        deps = kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments")["items"]
        svcs = kube.request("GET", f"/api/v1/namespaces/{ns}/services")["items"]
        if len(deps) >= n and len(svcs) >= n:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"only {len(deps)} Deployments / {len(svcs)} Services of {n} after {timeout}s")
        time.sleep(0.05)


def burst(kube: Kube, n: int) -> tuple[float, float]:
    ns = make_ns(kube, "bench-burst")
    t0 = time.perf_counter()
    for i in range(n):
        create_cr(kube, ns, f"burst-{i}")
    created = time.perf_counter() - t0
    return created, created + wait_children(kube, ns, n)


def floor(kube: Kube, n: int) -> float:
    """The same children applied directly by this process, one after another: what the API server costs."""
    ns = make_ns(kube, "bench-floor")
    spec = parse_spec(SPEC)
    t0 = time.perf_counter()
    for i in range(n):
        meta = Meta(f"floor-{i}", ns)
        kube.apply(build_deployment(spec, meta))
        kube.apply(build_service(spec, meta))
    return time.perf_counter() - t0


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-crs", type=int, default=50)
    ap.add_argument("--burst-crs", type=int, default=100)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gemma-bench-operator-"))
    cp = ControlPlane(work / "k8s")
    t = time.perf_counter()
    cp.start()
    print(f"control plane up in {time.perf_counter() - t:.1f}s ({work})", flush=True)
    cluster = Cluster(cp)
    kube = Kube(cluster.api)
    try:
        install_crd(cluster)
        direct = floor(kube, args.burst_crs)  # before the operator starts, so nothing else loads the API server
        op = start_operator(least_privilege_kubeconfig(cluster, kube, work / "operator.kubeconfig"),
                            work / "operator.log", resync="15")
        try:
            rss_idle = peak_rss_mib(op.proc.pid)
            lat = latency(kube, args.latency_crs)
            print(f"CR created -> Deployment present, {len(lat)} CRs one at a time: "
                  f"p50 {1000 * statistics.median(lat):.0f} ms, p95 {1000 * percentile(lat, 0.95):.0f} ms, "
                  f"max {1000 * max(lat):.0f} ms", flush=True)
            created, total = burst(kube, args.burst_crs)
            print(f"{args.burst_crs} CRs created back to back in {created:.2f}s; all have Deployment + Service "
                  f"after {total:.2f}s", flush=True)
            print(f"floor: the same {2 * args.burst_crs} children applied directly in {direct:.2f}s; "
                  f"operator / direct = {total / direct:.2f}x", flush=True)
            print(f"operator peak RSS: {peak_rss_mib(op.proc.pid):.0f} MiB (after start: {rss_idle:.0f} MiB), "
                  f"{args.latency_crs + args.burst_crs} CRs", flush=True)
            if not op.alive():
                print("operator died:\n" + op.tail(), file=sys.stderr)
                return 1
        finally:
            stop_operator(op)
    finally:
        cp.stop()
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
