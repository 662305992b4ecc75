"""The InferencePool (gemma_operator/builders/inference_pool.py): golden dicts, no cluster involved."""

from __future__ import annotations

from gemma_operator.builders.inference_pool import build_inference_pool, selects_pods_of

from .specs import LABELS, META, SELECTOR, tpu_spec


def test_inference_pool_selects_the_pods_on_the_server_port_and_names_the_picker():
    spec = tpu_spec(server={"port": 9000}, gateway={"inferencePool": True, "endpointPicker": {"name": "epp"}})
    assert build_inference_pool(spec, META) == {
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"selector": {"matchLabels": SELECTOR}, "targetPorts": [{"number": 9000}],
                 "endpointPickerRef": {"name": "epp", "group": "", "kind": "Service", "port": {"number": 9002},
                                       "failureMode": "FailClose"}},
    }


def test_a_pool_selects_the_servers_pods_when_every_label_it_names_is_theirs():
    def pool(match):
        return {"spec": {"selector": {"matchLabels": match}}}

    assert selects_pods_of(pool({"app.kubernetes.io/instance": "gemma"}), META)  # as the upstream chart is set
    assert selects_pods_of(pool(SELECTOR), META)
    assert not selects_pods_of(pool({"app.kubernetes.io/instance": "other"}), META)
    assert not selects_pods_of(pool({**SELECTOR, "tier": "x"}), META)
    assert not selects_pods_of(pool({}), META)  # an empty selector is not ours to judge
