"""Fixtures for the chart tests: the real helm binary and a renderer.

helm is the one tests/cluster/build_binaries.sh builds from the Go module proxy into the control plane's
cache (~/.cache/gemma-rust-operator/k8s-v<version>/bin), so the static chart tests and the end-to-end
test run the same helm; the static tests build it alone when it is missing. `helm template` gets --kube-version, because a helm built with `go build` (no
release ldflags) assumes Kubernetes 1.20 when no cluster is asked, below the chart's kubeVersion.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.cluster import controlplane

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gemma-rust-operator"


def helm_binary() -> Path:
    """The cached helm, built on its own when it is missing (not the whole control plane: `make test-fast`
    runs the chart's static tests)."""
    helm = controlplane.BIN_DIR / "helm"
    if not helm.is_file():
        controlplane.ensure_binaries(helm_only=True)
    return helm


class Helm:
    """Runs helm with an isolated config/cache, so no user's repositories or plugins leak in."""

    def __init__(self, binary: Path, home: Path):
        self.binary = binary
        self.env = {"HELM_CONFIG_HOME": str(home / "config"), "HELM_CACHE_HOME": str(home / "cache"),
                    "HELM_DATA_HOME": str(home / "data"), "PATH": "/usr/bin:/bin", "HOME": str(home)}

    def run(self, *args: str, check: bool = True, kubeconfig: Path | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
        env = dict(self.env)
        if kubeconfig:
            env["KUBECONFIG"] = str(kubeconfig)
        p = subprocess.run([str(self.binary), *args], capture_output=True, text=True, env=env, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p

    def template(self, *set_args: str, release: str = "grs", namespace: str = "gemma-system",
                 check: bool = True) -> subprocess.CompletedProcess:
        """`helm template` of the chart; each set_args item is a --set KEY=VALUE (or a raw flag)."""
        args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", controlplane.K8S_VERSION]
        for a in set_args:
            args += [a] if a.startswith("--") else ["--set", a]
        return self.run(*args, check=check)

    def render(self, *set_args: str, **kw) -> list[dict]:
        """The rendered manifests as objects (hooks included), in helm's order."""
        return [d for d in yaml.safe_load_all(self.template(*set_args, **kw).stdout) if d]


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> Helm:
    return Helm(helm_binary(), tmp_path_factory.mktemp("helm-home"))


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    """The one rendered object of `kind` (and `name`); fails listing what was rendered otherwise."""
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, rendered: {[(d['kind'], d['metadata']['name']) for d in docs]}"
    return hits[0]
