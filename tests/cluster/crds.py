"""Third-party CRDs for the operator's optional kinds, as their projects publish them: KEDA's ScaledObject
(github.com/kedacore/keda/v2, config/crd/bases/keda.sh_scaledobjects.yaml, with the other kinds KEDA's operator
watches), the KEDA HTTP add-on's HTTPScaledObject (github.com/kedacore/http-add-on, config/crd/bases/) and the
Gateway API inference
extension's InferencePool, with the InferenceObjective and InferenceModelRewrite CRDs its endpoint picker
watches (sigs.k8s.io/gateway-api-inference-extension, config/crd/bases/), fetched from the Go module proxy by
tests/cluster/fetch_crds.sh (`make test` runs it; `make k8s-crds` alone) into the cache, keyed by version.
GKE's HealthCheckPolicy and GCPBackendPolicy CRDs are nowhere to fetch: hand-written stand-ins (FAKE_GKE_*).

A test installs one into the session's control plane with `installed(cluster, CRD)` or makes sure it is
absent with `absent(cluster, CRD)`, so the order in which tests run does not matter.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

from .controlplane import GIE_VERSION, KEDA_HTTP_VERSION, KEDA_VERSION  # one pin for the CRDs and the binaries

CACHE = Path(os.environ.get("GEMMA_CACHE", Path.home() / ".cache" / "gemma-rust-operator")) / "crds"
FETCH_SCRIPT = Path(__file__).with_name("fetch_crds.sh")


class ThirdPartyCRD(NamedTuple):
    name: str       # metadata.name
    path: Path      # the cached file
    group_version: str


_KEDA = CACHE / f"keda-{KEDA_VERSION}"
SCALED_OBJECTS = ThirdPartyCRD("scaledobjects.keda.sh", _KEDA / "keda.sh_scaledobjects.yaml", "keda.sh/v1alpha1")
# The other kinds KEDA's operator watches (cmd/operator/main.go sets up a controller for each): it needs them to start.
KEDA_OPERATOR_CRDS = [SCALED_OBJECTS] + [
    ThirdPartyCRD(f"{plural}.{group}", _KEDA / f"{group}_{plural}.yaml", f"{group}/v1alpha1")
    for group, plural in (("keda.sh", "scaledjobs"), ("keda.sh", "triggerauthentications"),
                          ("keda.sh", "clustertriggerauthentications"), ("eventing.keda.sh", "cloudeventsources"),
                          ("eventing.keda.sh", "clustercloudeventsources"))]
HTTP_SCALED_OBJECTS = ThirdPartyCRD(
    "httpscaledobjects.http.keda.sh",
    CACHE / f"keda-http-add-on-{KEDA_HTTP_VERSION}" / "http.keda.sh_httpscaledobjects.yaml", "http.keda.sh/v1alpha1")
_GIE = CACHE / f"gateway-api-inference-extension-{GIE_VERSION}"
INFERENCE_POOLS = ThirdPartyCRD("inferencepools.inference.networking.k8s.io",
                                _GIE / "inference.networking.k8s.io_inferencepools.yaml", "inference.networking.k8s.io/v1")
# What the endpoint picker watches besides pools and pods (pkg/epp/controller/*_reconciler.go).
INFERENCE_OBJECTIVES = ThirdPartyCRD("inferenceobjectives.inference.networking.x-k8s.io",
                                     _GIE / "inference.networking.x-k8s.io_inferenceobjectives.yaml",
                                     "inference.networking.x-k8s.io/v1alpha2")
INFERENCE_MODEL_REWRITES = ThirdPartyCRD("inferencemodelrewrites.inference.networking.x-k8s.io",
                                         _GIE / "inference.networking.x-k8s.io_inferencemodelrewrites.yaml",
                                         "inference.networking.x-k8s.io/v1alpha2")


# FAKE stand-ins for GKE's HealthCheckPolicy and GCPBackendPolicy CRDs (tests/cluster/fake-crds/): GKE installs
# the real ones with its Gateway controller, and no Go module publishes them.
_FAKES = Path(__file__).with_name("fake-crds")
FAKE_GKE_HEALTH_CHECK_POLICIES = ThirdPartyCRD("healthcheckpolicies.networking.gke.io",
                                               _FAKES / "networking.gke.io_healthcheckpolicies.yaml",
                                               "networking.gke.io/v1")
FAKE_GKE_BACKEND_POLICIES = ThirdPartyCRD("gcpbackendpolicies.networking.gke.io",
                                          _FAKES / "networking.gke.io_gcpbackendpolicies.yaml", "networking.gke.io/v1")


def _served(cluster, crd: ThirdPartyCRD) -> bool:
    """Whether the API server lists `crd`'s resource (its group may stay served by another CRD)."""
    out = cluster.kubectl("get", "--raw", f"/apis/{crd.group_version}", check=False)
    plural = crd.name.split(".", 1)[0]
    return out.returncode == 0 and any(r["name"] == plural for r in json.loads(out.stdout)["resources"])


def installed(cluster, crd: ThirdPartyCRD) -> None:
    """Install `crd` unless it is there, and wait until it is served. kube-controller-manager is restarted
    after a new install so its garbage collector watches the new kind now, not up to 30 s later
    (tests/cluster/controlplane.py, ControlPlane.restart)."""
    if not crd.path.is_file():
        raise AssertionError(f"{crd.path} is missing: run `bash {FETCH_SCRIPT}` (make test does)")
    new = cluster.kubectl("get", "crd", crd.name, check=False).returncode != 0
    cluster.kubectl("apply", "--server-side", "-f", str(crd.path))
    from tests.operator.harness import wait_for

    def established() -> bool:
        # Not `kubectl wait`: it fails at once while a new CRD has no status.conditions yet.
        out = cluster.kubectl("get", "crd", crd.name, "-o", "json")
        conditions = json.loads(out.stdout).get("status", {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)
    wait_for(established, timeout=60, what=f"CRD {crd.name} Established")
    if new:
        cluster.cp.restart("kube-controller-manager")


def absent(cluster, crd: ThirdPartyCRD) -> None:
    """Delete `crd` (with its objects) if it is there, and wait until its resource is no longer served."""
    cluster.kubectl("delete", "crd", crd.name, "--ignore-not-found", "--wait=true", "--timeout=60s")
    from tests.operator.harness import wait_for

    wait_for(lambda: not _served(cluster, crd), timeout=30, what=f"{crd.name} to be no longer served")


def crd_names(crd: ThirdPartyCRD) -> dict:
    """The CRD file's names block (kind, plural), for assertions that the table agrees with upstream."""
    import yaml

    return yaml.safe_load(crd.path.read_text())["spec"]["names"]

