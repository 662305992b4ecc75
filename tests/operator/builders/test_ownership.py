"""Labels, owner references and foreign objects
(gemma_operator/builders/ownership.py): golden dicts, no cluster involved."""

from __future__ import annotations

from gemma_operator.builders.ownership import adopt, foreign, selector_string
from gemma_operator.builders.service import build_service

from .specs import META, tpu_spec


def test_adopt_sets_a_controller_owner_reference_without_mutating():
    child = build_service(tpu_spec(), META)
    owner = {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
             "metadata": {"name": "gemma", "uid": "1234"}}
    adopted = adopt(child, owner)
    assert adopted["metadata"]["ownerReferences"] == [
        {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer", "name": "gemma", "uid": "1234",
         "controller": True, "blockOwnerDeletion": True}]
    assert "ownerReferences" not in child["metadata"]


def test_foreign_names_why_an_object_is_not_this_servers_child():
    def existing(*refs):
        return {"metadata": {"name": "gemma", "ownerReferences": list(refs)}}
    ours = {"kind": "GemmaRustServer", "name": "gemma", "uid": "1234", "controller": True}
    assert foreign(None, "1234") is None
    assert foreign(existing(ours), "1234") is None
    assert foreign(existing(), "1234") == "it has no controller"
    assert foreign(existing({**ours, "controller": False}), "1234") == "it has no controller"
    assert foreign(existing({"kind": "ReplicaSet", "name": "web", "uid": "9", "controller": True}), "1234") == (
        "its controller is ReplicaSet web")
    # Same name and kind, but another (deleted and re-created) GemmaRustServer's.
    assert foreign(existing({**ours, "uid": "5678"}), "1234") == "its controller is GemmaRustServer gemma"


def test_selector_string():
    assert selector_string(META) == "app.kubernetes.io/instance=gemma,app.kubernetes.io/name=gemma-rust-server"
