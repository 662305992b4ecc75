"""pytest plugin: the session-wide local control plane (`cluster` fixture).

Register it with `pytest_plugins = ["tests.cluster.plugin"]` in tests/conftest.py (or `-p tests.cluster.plugin`).
Tests that use the fixture are marked `cluster`. The first run ever builds the binaries (many minutes, see
tests/cluster/build_binaries.sh); later runs reuse ~/.cache/gemma-rust-operator. A failed build or start
fails the tests that need it, with the log's tail: it never skips.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from .controlplane import ControlPlane


class Cluster:
    """What a test gets: the running control plane, its kubeconfig and an API client."""

    def __init__(self, cp: ControlPlane):
        import kubernetes

        self.cp = cp
        self.kubeconfig = cp.kubeconfig
        self.bin = cp.bin
        self.api = kubernetes.config.new_client_from_config(config_file=str(cp.kubeconfig))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True):
        """Run kubectl against the cluster (CompletedProcess; CalledProcessError when check fails)."""
        return self.cp.kubectl(*args, input=input, check=check)


@contextmanager
def running_cluster(workdir: Path) -> Iterator[Cluster]:
    """A control plane started in `workdir`, stopped on exit (also when its start fails)."""
    cp = ControlPlane(workdir)
    try:
        cp.start()
        yield Cluster(cp)
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("k8s")) as c:
        yield c
