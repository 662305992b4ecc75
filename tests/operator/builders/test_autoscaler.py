"""Which autoscaler a server gets (gemma_operator/builders/autoscaler.py): the one decision as a table, spec and
what the cluster serves -> the Autoscaling chosen; no cluster involved."""

from __future__ import annotations

import pytest

from gemma_operator.builders.autoscaler import Autoscaling, choose
from gemma_operator.builders.autoscaling import METRIC, PICKER_QUEUE, REQUESTS
from gemma_operator.builders.children import build_children
from gemma_operator.builders.endpoint_picker import build_picker_config

from .specs import EVERYTHING, META, tpu_spec

SO, HTTP_SO, HPA = "ScaledObject", "HTTPScaledObject", "HorizontalPodAutoscaler"
KEDA_API, ADD_ON_API, HPA_API = "keda.sh/v1alpha1", "http.keda.sh/v1alpha1", "autoscaling/v2"
NO_ADD_ON = EVERYTHING - {ADD_ON_API}
NO_KEDA = EVERYTHING - {KEDA_API, ADD_ON_API}
ADD_ON_ONLY = EVERYTHING - {KEDA_API}
NO_HPA = EVERYTHING - {HPA_API}

PROMETHEUS = {"prometheus": {"serverAddress": "http://p:9090"}}
POOL = {"inferencePool": True, "endpointPicker": {"name": "epp"}}
WAITING = "gemma_num_requests_waiting 4 per pod"
IN_FLIGHT = "requests in flight at the KEDA HTTP add-on 8 per pod, to zero after 600s idle"
QUEUED = "requests queued at the endpoint picker, 1 wakes it"
HELD = ("ScaleToZeroUnavailable", "spec.autoscaling.minReplicas 0 needs the KEDA HTTP add-on to hold and count the "
        "requests sent at zero: http.keda.sh/v1alpha1 is not served by this cluster: CRD "
        "httpscaledobjects.http.keda.sh is not installed (install the KEDA HTTP add-on); until it is, the server "
        "keeps at least 1 replica")


def server(autoscaling: dict | None, gateway: dict | None = None):
    """A CPU server with `autoscaling` (maxReplicas 4, target 4 unless told) and `gateway`."""
    scaled = {"autoscaling": {"maxReplicas": 4, "target": 4, **autoscaling}} if autoscaling is not None else {}
    return tpu_spec(accelerator={"type": "cpu"}, monitoring={"podMonitoring": False}, gateway=gateway or {}, **scaled)


# (spec.autoscaling, spec.gateway, what the cluster serves) -> (kinds, replaces, floor, triggers, warning, summary);
# maxReplicas is 4 throughout.
TABLE = {
    "no autoscaling: none, and nothing to keep":
        (None, None, EVERYTHING, Autoscaling()),
    "provider HPA":
        ({"provider": "HPA", "minReplicas": 2}, None, EVERYTHING,
         ((HPA,), (SO,), 2, (METRIC,), None, f"2..4 replicas, {WAITING}")),
    "Auto without Prometheus: an HPA though KEDA is there":
        ({}, None, EVERYTHING, ((HPA,), (SO,), 1, (METRIC,), None, f"1..4 replicas, {WAITING}")),
    "Auto with Prometheus and KEDA: KEDA":
        (PROMETHEUS, None, EVERYTHING, ((SO,), (HPA,), 1, (METRIC,), None, f"1..4 replicas, {WAITING}")),
    "Auto with Prometheus, no KEDA: the HPA stands in":
        (PROMETHEUS, None, NO_KEDA, ((HPA,), (SO,), 1, (METRIC,), None, f"1..4 replicas, {WAITING}")),
    "provider KEDA, no KEDA: asked for all the same (skipped), no stand-in, nothing replaced":
        ({"provider": "KEDA", **PROMETHEUS}, None, NO_KEDA,
         ((SO,), (), 1, (METRIC,), None, f"1..4 replicas, {WAITING}")),
    "no autoscaling/v2: the HPA asked for (skipped), nothing replaced":
        ({}, None, NO_HPA, ((HPA,), (), 1, (METRIC,), None, f"1..4 replicas, {WAITING}")),
    "at zero: KEDA on the add-on's requests alone":
        ({"minReplicas": 0}, None, EVERYTHING,
         ((SO, HTTP_SO), (HPA,), 0, (REQUESTS,), None, f"0..4 replicas, {IN_FLIGHT}")),
    "at zero with Prometheus: the gauge beside the requests":
        ({"minReplicas": 0, **PROMETHEUS}, None, EVERYTHING,
         ((SO, HTTP_SO), (HPA,), 0, (METRIC, REQUESTS), None, f"0..4 replicas, {WAITING}, {IN_FLIGHT}")),
    "at zero behind an InferencePool: the picker's queue wakes it too":
        ({"minReplicas": 0, **PROMETHEUS}, POOL, EVERYTHING,
         ((SO, HTTP_SO), (HPA,), 0, (METRIC, REQUESTS, PICKER_QUEUE), None,
          f"0..4 replicas, {WAITING}, {IN_FLIGHT}, {QUEUED}")),
    "at zero, the add-on without KEDA: KEDA asked for (skipped), no HPA stands in":
        ({"minReplicas": 0}, None, ADD_ON_ONLY,
         ((SO, HTTP_SO), (), 0, (REQUESTS,), None, f"0..4 replicas, {IN_FLIGHT}")),
    "at zero without the add-on: held at one by KEDA on the gauge":
        ({"minReplicas": 0, **PROMETHEUS}, None, NO_ADD_ON,
         ((SO,), (HPA,), 1, (METRIC,), HELD, f"1..4 replicas, {WAITING}")),
    "at zero behind a pool without the add-on: held at one, no queue trigger":
        ({"minReplicas": 0, **PROMETHEUS}, POOL, NO_ADD_ON,
         ((SO,), (HPA,), 1, (METRIC,), HELD, f"1..4 replicas, {WAITING}")),
    "at zero without the add-on or Prometheus: held at one by an HPA":
        ({"minReplicas": 0}, None, NO_ADD_ON, ((HPA,), (SO,), 1, (METRIC,), HELD, f"1..4 replicas, {WAITING}")),
    "provider KEDA at zero without the add-on or Prometheus: held at one by an HPA":
        ({"minReplicas": 0, "provider": "KEDA"}, None, NO_ADD_ON,
         ((HPA,), (SO,), 1, (METRIC,), HELD, f"1..4 replicas, {WAITING}")),
    "at zero with Prometheus, neither KEDA nor the add-on: held at one, the HPA stands in":
        ({"minReplicas": 0, **PROMETHEUS}, None, NO_KEDA,
         ((HPA,), (SO,), 1, (METRIC,), HELD, f"1..4 replicas, {WAITING}")),
    "provider KEDA at zero, neither KEDA nor the add-on: held at one, KEDA asked for (skipped)":
        ({"minReplicas": 0, "provider": "KEDA", **PROMETHEUS}, None, NO_KEDA,
         ((SO,), (), 1, (METRIC,), HELD, f"1..4 replicas, {WAITING}")),
}


def expected(row: Autoscaling | tuple) -> Autoscaling:
    if isinstance(row, Autoscaling):
        return row
    kinds, replaces, floor, triggers, warning, summary = row
    return Autoscaling(kinds, replaces, floor, 4, triggers, warning, summary)


@pytest.mark.parametrize("autoscaling,gateway,available,decision", TABLE.values(), ids=TABLE)
def test_the_autoscaler_chosen_for_each_spec_and_cluster(autoscaling, gateway, available, decision):
    assert choose(server(autoscaling, gateway), available) == expected(decision)


@pytest.mark.parametrize("autoscaling,gateway,available,decision", TABLE.values(), ids=TABLE)
def test_children_build_what_was_chosen_and_skip_only_what_the_cluster_lacks(autoscaling, gateway, available,
                                                                            decision):
    spec = server(autoscaling, gateway)
    before = spec.model_copy(deep=True)
    kids = build_children(spec, META, available)
    chosen = expected(decision)
    assert kids.scaling == chosen and spec == before  # the user's spec is read, never rewritten
    api = {SO: KEDA_API, HTTP_SO: ADD_ON_API, HPA: HPA_API}
    assert [o["kind"] for o in kids.apply if o["kind"] in api] == [k for k in chosen.kinds if api[k] in available]
    assert [kind for kind, _ in kids.skipped if kind in api] == [k for k in chosen.kinds if api[k] not in available]
    # The rival goes on every sync where it is served; a kind neither chosen nor a rival only when the spec changes.
    assert [kind for _, kind, _ in kids.replaced] == [k for k in chosen.replaces if api[k] in available]
    assert {kind for _, kind, _ in kids.absent if kind in api} == {
        k for k in api if api[k] in available and k not in chosen.kinds + chosen.replaces}


def test_a_server_held_at_one_runs_one_replica_and_its_picker_holds_no_requests():
    """The floor is the decision's: the Deployment of a server at zero (spec.replicas 0, as KEDA left it) gets one
    replica while the add-on is missing, and the picker no flow control, since nothing would wake the pool."""
    spec = server({"minReplicas": 0, **PROMETHEUS}, POOL).model_copy(update={"replicas": 0})

    def deployment_replicas(available):
        (dep,) = [o for o in build_children(spec, META, available).apply if o["kind"] == "Deployment"]
        return dep["spec"]["replicas"]

    assert deployment_replicas(NO_ADD_ON) == 1 and deployment_replicas(EVERYTHING) == 0
    assert "flowControl" not in build_picker_config(spec, choose(spec, NO_ADD_ON))
    assert "flowControl" in build_picker_config(spec, choose(spec, EVERYTHING))
