"""Third-party CRDs for the operator's optional kinds, as their projects publish them: KEDA's ScaledObject
(github.com/kedacore/keda/v2, config/crd/bases/keda.sh_scaledobjects.yaml) and the Gateway API inference
extension's InferencePool (sigs.k8s.io/gateway-api-inference-extension, config/crd/bases/
inference.networking.k8s.io_inferencepools.yaml), fetched from the Go module proxy by
tests/cluster/fetch_crds.sh (`make test` runs it; `make k8s-crds` alone) into the cache, keyed by version.

A test installs one into the session's control plane with `installed(cluster, CRD)` or makes sure it is
absent with `absent(cluster, CRD)`, so the order in which tests run does not matter.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

CACHE = Path(os.environ.get("GEMMA_CACHE", Path.home() / ".cache" / "gemma-rust-operator")) / "crds"
FETCH_SCRIPT = Path(__file__).with_name("fetch_crds.sh")


class ThirdPartyCRD(NamedTuple):
    name: str       # metadata.name
    path: Path      # the cached file
    group_version: str


KEDA_VERSION = os.environ.get("KEDA_VERSION", "v2.21.0")
GIE_VERSION = os.environ.get("GIE_VERSION", "v1.2.0")
SCALED_OBJECTS = ThirdPartyCRD("scaledobjects.keda.sh", CACHE / f"keda-{KEDA_VERSION}" / "keda.sh_scaledobjects.yaml",
                               "keda.sh/v1alpha1")
INFERENCE_POOLS = ThirdPartyCRD(
    "inferencepools.inference.networking.k8s.io",
    CACHE / f"gateway-api-inference-extension-{GIE_VERSION}" / "inference.networking.k8s.io_inferencepools.yaml",
    "inference.networking.k8s.io/v1")


def _served(cluster, crd: ThirdPartyCRD) -> bool:
    return cluster.kubectl("get", "--raw", f"/apis/{crd.group_version}", check=False).returncode == 0


def installed(cluster, crd: ThirdPartyCRD) -> None:
    """Install `crd` unless it is there, and wait until it is served. kube-controller-manager is restarted
    after a new install so its garbage collector watches the new kind now, not up to 30 s later
    (tests/cluster/controlplane.py, ControlPlane.restart)."""
    if not crd.path.is_file():
        raise AssertionError(f"{crd.path} is missing: run `bash {FETCH_SCRIPT}` (make test does)")
    new = cluster.kubectl("get", "crd", crd.name, check=False).returncode != 0
    cluster.kubectl("apply", "--server-side", "-f", str(crd.path))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd.name}")
    if new:
        cluster.cp.restart("kube-controller-manager")


def absent(cluster, crd: ThirdPartyCRD) -> None:
    """Delete `crd` (with its objects) if it is there, and wait until its API is no longer served."""
    cluster.kubectl("delete", "crd", crd.name, "--ignore-not-found", "--wait=true", "--timeout=60s")
    from tests.operator.harness import wait_for

    wait_for(lambda: not _served(cluster, crd), timeout=30, what=f"{crd.group_version} to be no longer served")


def crd_names(crd: ThirdPartyCRD) -> dict:
    """The CRD file's names block (kind, plural), for assertions that the table agrees with upstream."""
    import yaml

    return yaml.safe_load(crd.path.read_text())["spec"]["names"]

