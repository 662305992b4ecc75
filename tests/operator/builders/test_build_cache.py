"""The build cache claim, its name and its volume
(gemma_operator/builders/build_cache.py): golden dicts, no cluster involved."""

from __future__ import annotations

import re

import pytest

from gemma_operator.builders.build_cache import (build_build_cache_pvc, build_cache_claim_name,
                                                 legacy_build_cache_claim_name)
from gemma_operator.builders.deployment import build_deployment, claims
from gemma_operator.builders.ownership import Meta
from gemma_operator.spec import parse_spec

from .specs import LABELS, META


def test_pvc_model_source_and_pvc_build_cache():
    spec = parse_spec({"model": {"source": "pvc://models/gemma/e2b"},
                       "buildCache": {"type": "pvc", "size": "50Gi", "storageClassName": "premium-rwo"}})
    dep = build_deployment(spec, META)
    pod = dep["spec"]["template"]["spec"]
    assert pod["volumes"] == [
        {"name": "build-cache", "persistentVolumeClaim": {"claimName": "gemma-build-cache-0d9b6a3c"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        # The pod's own compilation cache beside the shared one on the PVC (gemma_server/compile_cache.py).
        {"name": "tpu-compile-local", "emptyDir": {"sizeLimit": "10Gi"}},
    ]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["GEMMA_MODEL"] == "/models/pvc/models/gemma/e2b"
    assert build_build_cache_pvc(spec, META) == {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "gemma-build-cache-0d9b6a3c", "namespace": "serving", "labels": LABELS},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "50Gi"}},
                 "storageClassName": "premium-rwo"},
    }


def test_the_build_cache_claim_is_named_after_the_uid_so_a_name_cannot_aim_at_an_existing_claim():
    # Two servers named alike in turn (the second after the first was deleted) get different claims, and
    # no spec names the claim: `ci` does not become `ci-build-cache`.
    first, second = Meta("ci", "ns", "a1b2c3d4-0000"), Meta("ci", "ns", "e5f6a7b8-0000")
    assert build_cache_claim_name(first) == "ci-build-cache-a1b2c3d4"
    assert build_cache_claim_name(second) == "ci-build-cache-e5f6a7b8"
    assert legacy_build_cache_claim_name(first) == "ci-build-cache"
    with pytest.raises(ValueError, match="uid"):
        build_cache_claim_name(Meta("ci", "ns"))


@pytest.mark.parametrize("name", ["a" * 63, "a" * 41 + ".b" * 5, "a" * 41 + "-b" * 5])
def test_a_long_name_is_cut_so_the_claim_name_stays_a_dns_label(name):
    claim = build_cache_claim_name(Meta(name, "ns", "a1b2c3d4-0000"))
    assert len(claim) <= 63 and claim.endswith("-build-cache-a1b2c3d4")
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", claim) and ".-" not in claim


def test_a_legacy_claim_this_server_owns_stays_its_build_cache():
    spec = parse_spec({"model": {"source": "hf://o/m"}, "buildCache": {"type": "pvc"}})
    legacy = META._replace(legacy_build_cache=True)
    assert build_build_cache_pvc(spec, legacy)["metadata"]["name"] == "gemma-build-cache"
    assert claims(build_deployment(spec, legacy)) == {"gemma-build-cache"}
    assert claims(build_deployment(spec, META)) == {"gemma-build-cache-0d9b6a3c"}
    pvc_source = parse_spec({"model": {"source": "pvc://weights/x"}, "buildCache": {"type": "pvc"}})
    assert claims(build_deployment(pvc_source, META)) == {"weights", "gemma-build-cache-0d9b6a3c"}
