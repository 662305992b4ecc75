"""The operator (a real `kopf run` process) against the local control plane: real kube-apiserver admission
and CEL, real scheduler placing pods on GKE-labelled TPU v5e nodes, real garbage collector, kwok kubelets."""

from __future__ import annotations

import json

import pytest

from gemma_operator.poller import TEST_URL_ANNOTATION
from tests.cluster.controlplane import BOOT_ANNOTATION, TERMINATION_ANNOTATION

from .harness import PROMETHEUS, condition, create, dump, get, wait_for
from .fakes import FakeEngineEndpoint

pytestmark = pytest.mark.cluster

CPU = {"type": "cpu"}


def model(source="hf://google/gemma-4-e2b-it"):
    return {"source": source}


def deployment(kube, ns, name):
    return kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")


def pods(kube, ns, name):
    sel = f"app.kubernetes.io/instance={name},app.kubernetes.io/name=gemma-rust-server"
    return kube.list_pods(ns, sel)


def live_pods(kube, ns, name):
    return [p for p in pods(kube, ns, name) if not p["metadata"].get("deletionTimestamp")]


def node(kube, name):
    return kube.request("GET", f"/api/v1/nodes/{name}")


def status_of(obj):
    return obj.get("status") or {}


def phase_is(kube, ns, name, phase):
    def check():
        obj = get(kube, ns, name)
        return obj if (obj.get("status") or {}).get("phase") == phase else None
    return check


def wait_phase(kube, ns, name, phase, operator, timeout=45):
    return wait_for(phase_is(kube, ns, name, phase), timeout=timeout, what=f"{name} phase {phase}",
                    diagnose=lambda: dump(get(kube, ns, name).get("status")) + "\n" + operator.tail(30))


def scheduled_node(kube, ns, name, operator):
    pod = wait_for(lambda: next((p for p in live_pods(kube, ns, name) if p["spec"].get("nodeName")), None),
                   what=f"a pod of {name} scheduled", diagnose=operator.tail)
    return node(kube, pod["spec"]["nodeName"]), pod


def test_cr_yields_owned_children_with_the_right_fields(kube, ns, operator):
    obj = create(kube, ns, "g", {"model": model(), "accelerator": {"topology": "1x1"}})
    dep = wait_for(lambda: deployment(kube, ns, "g"), what="the Deployment", diagnose=operator.tail)
    svc = wait_for(lambda: kube.request("GET", f"/api/v1/namespaces/{ns}/services/g"), what="the Service")
    for child in (dep, svc):
        ref, = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("GemmaRustServer", "g",
                                                                              obj["metadata"]["uid"], True)
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "gemma-rust-operator"
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                   "cloud.google.com/gke-tpu-topology": "1x1"}
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["google.com/tpu"] == "1" and c["resources"]["requests"]["google.com/tpu"] == "1"
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert svc["spec"]["ports"][0]["port"] == 8000
    # Server-side apply: one field manager owns what the operator set.
    managers = {m["manager"] for m in dep["metadata"]["managedFields"] if m["operation"] == "Apply"}
    assert managers == {"gemma-rust-operator"}
    ready = wait_phase(kube, ns, "g", "Ready", operator)
    st = ready["status"]
    assert st["endpoint"] == f"http://g.{ns}.svc.cluster.local:8000/v1"
    assert (st["accelerator"], st["readyText"], st["observedGeneration"]) == ("v5e 1x1", "1/1", 1)
    assert condition(ready, "Ready")["status"] == "True"
    assert st["selector"] == "app.kubernetes.io/instance=g,app.kubernetes.io/name=gemma-rust-server"
    # No finalizer: a GemmaRustServer stays deletable when the operator is not running.
    assert not ready["metadata"].get("finalizers")


def test_pod_is_scheduled_on_a_v5e_node_of_the_requested_topology_never_the_cpu_node(kube, ns, operator):
    create(kube, ns, "one", {"model": model(), "accelerator": {"topology": "1x1"}})
    n, _ = scheduled_node(kube, ns, "one", operator)
    labels = n["metadata"]["labels"]
    assert labels["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"
    assert labels["cloud.google.com/gke-tpu-topology"] == "1x1"
    assert n["metadata"]["name"] != "cpu-a"


def test_2x2_requests_four_chips_on_a_2x2_node(kube, ns, operator):
    create(kube, ns, "quad", {"model": model(), "accelerator": {"topology": "2x2"}})
    n, pod = scheduled_node(kube, ns, "quad", operator)
    assert n["metadata"]["labels"]["cloud.google.com/gke-tpu-topology"] == "2x2"
    assert pod["spec"]["containers"][0]["resources"]["requests"]["google.com/tpu"] == "4"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == "4"


@pytest.mark.parametrize("topology,chips", [("1x1", "1"), ("2x4", "8")])
def test_v6e_lands_on_a_v6e_node_of_its_topology_never_a_v5e_one(cluster, kube, ns, operator, topology, chips):
    name = f"trillium-{topology}"
    create(kube, ns, name, {"model": model(), "accelerator": {"type": "tpu-v6e-slice", "topology": topology}})
    n, pod = scheduled_node(kube, ns, name, operator)
    labels = n["metadata"]["labels"]
    assert (labels["cloud.google.com/gke-tpu-accelerator"], labels["cloud.google.com/gke-tpu-topology"]) == (
        "tpu-v6e-slice", topology)
    assert labels["node.kubernetes.io/instance-type"] == f"ct6e-standard-{chips}t"
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources["requests"]["google.com/tpu"] == resources["limits"]["google.com/tpu"] == chips
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["GEMMA_DEVICE"] == "tpu" and env["GEMMA_DEVICES"] == chips
    obj = wait_phase(kube, ns, name, "Ready", operator)
    assert obj["status"]["accelerator"] == f"v6e {topology}"
    assert condition(obj, "Degraded").get("status") != "True"
    row = cluster.kubectl("get", "grs", name, "-n", ns).stdout
    assert f"v6e {topology}" in row


def test_spot_and_flex_start_select_matching_nodes(kube, ns, operator):
    create(kube, ns, "spot", {"model": model(), "accelerator": {"topology": "2x2", "provisioning": "spot"}})
    create(kube, ns, "flex", {"model": model(), "accelerator": {"topology": "1x1", "provisioning": "flex-start"}})
    spot, _ = scheduled_node(kube, ns, "spot", operator)
    flex, _ = scheduled_node(kube, ns, "flex", operator)
    assert spot["metadata"]["labels"].get("cloud.google.com/gke-spot") == "true"
    assert spot["metadata"]["labels"]["cloud.google.com/gke-tpu-topology"] == "2x2"
    assert flex["metadata"]["labels"].get("cloud.google.com/gke-flex-start") == "true"


def test_no_tpu_capacity_shows_scheduling_with_the_schedulers_message(cluster, kube, ns, operator):
    create(kube, ns, "big", {"model": model(), "accelerator": {"topology": "2x4"}})
    obj = wait_phase(kube, ns, "big", "Scheduling", operator)
    obj = wait_for(lambda: (lambda o: o if "nodes are available" in status_of(o).get("message", "") else None)(
        get(kube, ns, "big")), what="the scheduler's message in status")
    ready = condition(obj, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Unschedulable")
    assert "nodes are available" in ready["message"]
    assert obj["status"]["pods"][0]["reason"] == "Unschedulable"
    row = cluster.kubectl("get", "grs", "big", "-n", ns).stdout
    assert "Scheduling" in row and "Unschedulable" in row and "v5e 2x4" in row and "0/1" in row


def test_kubectl_scale_changes_replicas_and_the_pdb(cluster, kube, ns, operator):
    create(kube, ns, "s", {"model": model(), "accelerator": CPU})
    wait_phase(kube, ns, "s", "Ready", operator)
    cluster.kubectl("scale", "grs/s", "--replicas=3", "-n", ns)
    wait_for(lambda: deployment(kube, ns, "s")["spec"]["replicas"] == 3, what="Deployment replicas 3")
    obj = wait_for(lambda: (lambda o: o if status_of(o).get("readyReplicas") == 3 else None)(get(kube, ns, "s")),
                   what="3 ready replicas", diagnose=operator.tail)
    assert obj["status"]["replicas"] == 3 and obj["status"]["readyText"] == "3/3"
    pdb_path = f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/s"
    assert wait_for(lambda: kube.request("GET", pdb_path), what="the PDB")["spec"]["maxUnavailable"] == 1
    scale = kube.request("GET", f"/apis/gemmarust.dev/v1alpha1/namespaces/{ns}/gemmarustservers/s/scale")
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (3, 3)
    assert scale["status"]["selector"] == obj["status"]["selector"]
    cluster.kubectl("scale", "grs/s", "--replicas=1", "-n", ns)
    wait_for(lambda: deployment(kube, ns, "s")["spec"]["replicas"] == 1, what="Deployment replicas 1")

    def pdb_gone():
        try:
            kube.request("GET", pdb_path)
            return False
        except Exception as e:  # noqa: BLE001 - ApiError 404 is what we wait for
            return getattr(e, "status", None) == 404
    wait_for(pdb_gone, what="the PDB to be deleted at one replica", diagnose=operator.tail)


def test_new_image_rolls_out_with_recreate(kube, ns, operator):
    create(kube, ns, "r", {"model": model(), "accelerator": {"topology": "1x1"}, "image": "example.com/server:1"})
    wait_phase(kube, ns, "r", "Ready", operator)
    old = {p["metadata"]["name"] for p in live_pods(kube, ns, "r")}
    kube.request("PATCH", f"/apis/gemmarust.dev/v1alpha1/namespaces/{ns}/gemmarustservers/r",
                 {"spec": {"image": "example.com/server:2"}}, content_type="application/merge-patch+json")
    dep = wait_for(lambda: (lambda d: d if d["spec"]["template"]["spec"]["containers"][0]["image"]
                            == "example.com/server:2" else None)(deployment(kube, ns, "r")), what="new image")
    assert dep["spec"]["strategy"] == {"type": "Recreate"}

    def rolled():
        now = live_pods(kube, ns, "r")
        return len(now) == 1 and now[0]["metadata"]["name"] not in old and \
            now[0]["spec"]["containers"][0]["image"] == "example.com/server:2" and now[0]
    wait_for(rolled, what="the new pod replacing the old", diagnose=operator.tail)
    obj = wait_for(lambda: (lambda o: o if status_of(o).get("phase") == "Ready"
                            and status_of(o).get("observedGeneration") == 2 else None)(get(kube, ns, "r")),
                   what="Ready at generation 2", diagnose=operator.tail)
    assert obj["status"]["readyText"] == "1/1"


def test_deleted_cr_takes_its_children(cluster, kube, ns, operator):
    create(kube, ns, "gone", {"model": model(), "accelerator": CPU})
    wait_phase(kube, ns, "gone", "Ready", operator)
    cluster.kubectl("delete", "grs", "gone", "-n", ns, "--wait=true", "--timeout=60s")

    def children_gone():
        deps = kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments")["items"]
        svcs = kube.request("GET", f"/api/v1/namespaces/{ns}/services")["items"]
        return not deps and not svcs and not pods(kube, ns, "gone")
    wait_for(children_gone, what="garbage collection of the children", diagnose=operator.tail)


@pytest.mark.parametrize("spec,message", [
    ({"model": {"source": "s3://bucket/x"}},
     "model source must be hf://org/repo[@revision], gs://bucket/path"),
    ({"model": model(), "accelerator": {"type": "cpu", "topology": "2x2"}},
     "spec.accelerator.topology applies to TPUs only"),
    ({"model": model(), "resources": {"limits": {"google.com/tpu": 4}}},
     "spec.resources.limits must not set google.com/tpu"),
    ({"model": model(), "accelerator": {"topology": "4x4"}}, 'Unsupported value: "4x4"'),
    ({"model": model(), "replicas": 2, "buildCache": {"type": "pvc"}},
     "a ReadWriteOnce build cache PVC can serve one replica"),
    ({"model": model(), "accelerator": {"computeClass": "tpu", "provisioning": "spot"}},
     "spec.accelerator.computeClass decides provisioning itself"),
    ({"accelerator": CPU}, "spec.model: Required value"),
    ({"model": model(), "server": {"port": 8431}}, "spec.server.port must not be 8431"),
    ({"model": model(), "server": {"probePort": 8431}}, "spec.server.probePort must not be 8431"),
    ({"model": model(), "accelerator": {"topology": "2x2"}, "engine": {"tensorParallelSize": 3}},
     "spec.engine.tensorParallelSize must divide the slice's chips"),
    ({"model": model(), "engine": {"tensorParallelSize": 2}}, "spec.engine.tensorParallelSize must divide"),
    ({"model": model(), "accelerator": CPU, "engine": {"tensorParallelSize": 1}},
     "spec.engine.tensorParallelSize applies to TPUs only"),
])
def test_invalid_cr_is_refused_at_admission_with_its_message(cluster, ns, spec, message):
    import json

    doc = json.dumps({"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
                      "metadata": {"name": "bad", "namespace": ns}, "spec": spec})
    p = cluster.kubectl("apply", "-f", "-", input=doc, check=False)
    assert p.returncode != 0
    assert message in p.stderr, p.stderr


def test_unknown_accelerator_fails_without_a_deployment(kube, ns, operator):
    create(kube, ns, "v9", {"model": model(), "accelerator": {"type": "tpu-v9-slice"}})
    obj = wait_phase(kube, ns, "v9", "Failed", operator)
    assert condition(obj, "Degraded")["reason"] == "UnknownAccelerator"
    assert "tpu-v5-lite-podslice" in condition(obj, "Degraded")["message"]
    assert kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments")["items"] == []


def test_a_model_too_big_for_its_slice_fails_without_a_deployment(kube, ns, operator):
    create(kube, ns, "big", {"model": model("hf://google/gemma-4-31B-it"), "accelerator": {"topology": "1x1"}})
    obj = wait_phase(kube, ns, "big", "Failed", operator)
    assert condition(obj, "Degraded")["reason"] == "ModelDoesNotFit"
    assert "spec.accelerator.topology 2x4 (8 chips, tensorParallelSize 8)" in condition(obj, "Degraded")["message"]
    assert kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments")["items"] == []


def test_crashing_container_termination_message_reaches_the_cr(kube, ns, operator):
    reason = "smoke: tpu matmul mismatch (max abs err 3.1e-1)"
    create(kube, ns, "crash", {"model": model(), "accelerator": CPU,
                               "podAnnotations": {BOOT_ANNOTATION: "crash", TERMINATION_ANNOTATION: reason}})
    obj = wait_phase(kube, ns, "crash", "Failed", operator)
    assert condition(obj, "Degraded")["reason"] == "CrashLoopBackOff"
    assert reason in condition(obj, "Degraded")["message"]
    assert obj["status"]["lastFailure"]["message"] == reason
    assert obj["status"]["lastFailure"]["exitCode"] == 1


def test_a_termination_message_with_credentials_reaches_the_cr_redacted(kube, ns, operator):
    # What an image that prints its environment into /dev/termination-log would leave there.
    token = "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"
    dump = f"HF_TOKEN={token}\nGEMMA_API_KEY=s3cr3t-api-key\nHOME=/home/app"
    create(kube, ns, "leak", {"model": model(), "accelerator": CPU,
                              "podAnnotations": {BOOT_ANNOTATION: "crash", TERMINATION_ANNOTATION: dump}})
    obj = wait_phase(kube, ns, "leak", "Failed", operator)
    assert obj["status"]["lastFailure"]["message"] == "HF_TOKEN=[redacted]\nGEMMA_API_KEY=[redacted]\nHOME=[redacted]"
    text = json.dumps(obj["status"])
    assert token not in text and "s3cr3t" not in text


def test_engine_boot_stages_reach_the_status(kube, ns, operator):
    with FakeEngineEndpoint() as fake:
        create(kube, ns, "boot", {"model": model(), "accelerator": CPU,
                                  "podAnnotations": {BOOT_ANNOTATION: "hold-unready", TEST_URL_ANNOTATION: fake.url}})
        obj = wait_phase(kube, ns, "boot", "Building", operator)
        fake.boot_to("smoke", {"build": 61.2, "import": 0.8})
        obj = wait_phase(kube, ns, "boot", "SmokeTesting", operator)
        fake.boot_to("weights", {"build": 61.2, "import": 0.8, "smoke": 3.5})
        obj = wait_phase(kube, ns, "boot", "LoadingWeights", operator)
        pod = obj["status"]["pods"][0]
        assert pod["engineStage"] == "weights"
        assert pod["stages"][:3] == [{"stage": "build", "status": "ok", "seconds": 61.2},
                                     {"stage": "import", "status": "ok", "seconds": 0.8},
                                     {"stage": "smoke", "status": "ok", "seconds": 3.5}]
        fake.boot_to("warmup", {"build": 61.2, "import": 0.8, "smoke": 3.5, "weights": 20.0})
        wait_phase(kube, ns, "boot", "WarmingUp", operator)
        assert "/v1/engine" in fake.requests


def test_ready_pod_reports_its_served_model(kube, ns, operator):
    with FakeEngineEndpoint() as fake:
        fake.serve("gemma-4-e2b-it")
        create(kube, ns, "served", {"model": model(), "accelerator": CPU,
                                    "podAnnotations": {TEST_URL_ANNOTATION: fake.url}})
        obj = wait_for(lambda: (lambda o: o if status_of(o).get("servedModel") else None)(get(kube, ns, "served")),
                       what="servedModel in status", diagnose=operator.tail)
        assert obj["status"]["servedModel"] == "gemma-4-e2b-it"
        assert obj["status"]["pods"][0]["servedModel"] == "gemma-4-e2b-it"


def test_monitoring_is_skipped_with_a_condition_then_created_when_the_crd_appears(cluster, kube, ns, operator):
    import json

    create(kube, ns, "mon", {"model": model(), "accelerator": CPU})
    obj = wait_for(lambda: (lambda o: o if condition(o, "Monitoring") else None)(get(kube, ns, "mon")),
                   what="the Monitoring condition", diagnose=operator.tail)
    mon = condition(obj, "Monitoring")
    assert (mon["status"], mon["reason"]) == ("False", "MonitoringCRDMissing")
    assert "monitoring.googleapis.com/v1" in mon["message"]
    # GKE managed Prometheus' CRD, reduced to what the API server needs to serve the kind.
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "podmonitorings.monitoring.googleapis.com"},
           "spec": {"group": "monitoring.googleapis.com", "scope": "Namespaced",
                    "names": {"kind": "PodMonitoring", "plural": "podmonitorings", "singular": "podmonitoring",
                              "listKind": "PodMonitoringList"},
                    "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                        "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(crd))
    try:
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                        "crd/podmonitorings.monitoring.googleapis.com")
        # The operator re-checks discovery every few seconds here (GEMMA_OPERATOR_DISCOVERY_TTL_SECONDS).
        pm = wait_for(lambda: kube.request("GET", f"/apis/monitoring.googleapis.com/v1/namespaces/{ns}/podmonitorings/mon"),
                      timeout=45, what="the PodMonitoring", diagnose=operator.tail)
        assert pm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
        obj = wait_for(lambda: (lambda o: o if condition(o, "Monitoring").get("status") == "True" else None)(
            get(kube, ns, "mon")), what="Monitoring True")
    finally:
        cluster.kubectl("delete", "crd", "podmonitorings.monitoring.googleapis.com", "--wait=false")


def test_phase_transitions_post_events(cluster, kube, ns, operator):
    import json

    # 2x4 never schedules here (no such node), so Scheduling is observed for sure; then 1x1 makes it Ready.
    create(kube, ns, "ev", {"model": model(), "accelerator": {"topology": "2x4"}})
    wait_phase(kube, ns, "ev", "Scheduling", operator)
    kube.request("PATCH", f"/apis/gemmarust.dev/v1alpha1/namespaces/{ns}/gemmarustservers/ev",
                 {"spec": {"accelerator": {"topology": "1x1"}}}, content_type="application/merge-patch+json")
    wait_phase(kube, ns, "ev", "Ready", operator)

    def events():
        out = json.loads(cluster.kubectl("get", "events", "-n", ns, "--field-selector",
                                         "involvedObject.kind=GemmaRustServer,involvedObject.name=ev",
                                         "-o", "json").stdout)
        got = {e["reason"]: e for e in out["items"]}
        return got if {"Scheduling", "Ready"} <= set(got) else None
    got = wait_for(events, what="Scheduling and Ready events on the custom resource")
    assert got["Scheduling"]["type"] == "Normal"
    assert "-> Scheduling: pod ev-" in got["Scheduling"]["message"]
    assert got["Ready"]["message"].endswith("-> Ready: 1/1 replicas ready")
    assert got["Ready"]["source"]["component"] == "gemma-rust-operator"


def test_child_the_api_server_rejects_is_a_degraded_condition_not_a_crash(kube, ns, operator):
    # Node selector values are passed through unchecked by the CRD schema; the API server refuses this one.
    create(kube, ns, "sel", {"model": model(), "accelerator": CPU, "nodeSelector": {"pool": "not a label!"}})
    obj = wait_phase(kube, ns, "sel", "Degraded", operator)
    deg = condition(obj, "Degraded")
    assert deg["reason"] == "ApplyRejected"
    assert deg["message"].startswith("Deployment sel:") and "not a label!" in deg["message"], deg
    assert operator.alive()


@pytest.mark.parametrize("field,value,reason,named", [
    ("podAnnotations", {"container.apparmor.security.beta.kubernetes.io/server": "unconfined"},
     "PodAnnotationNotAllowed", "'container.apparmor.security.beta.kubernetes.io/server'"),
    ("tolerations", [{"operator": "Exists"}], "TolerationNotAllowed", "no key, so it tolerates every taint"),
    ("tolerations", [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}],
     "TolerationNotAllowed", "key 'node-role.kubernetes.io/control-plane'"),
    # An extended resource GKE would add a toleration for.
    ("resources", {"limits": {"nvidia.com/gpu": 1}}, "ExtendedResourceNotAllowed",
     "extended resource 'nvidia.com/gpu' (spec.resources.limits) not allowed by this operator "
     "(GEMMA_OPERATOR_ALLOWED_EXTENDED_RESOURCES"),
    # KEDA would query the API server, or a host that merely starts with the allowed address's text.
    ("autoscaling", {"maxReplicas": 2, "target": 1, "prometheus": {"serverAddress": "https://kubernetes.default.svc"}},
     "PrometheusAddressNotAllowed", "'https://kubernetes.default.svc' not allowed by this operator "
     "(GEMMA_OPERATOR_ALLOWED_PROMETHEUS_ADDRESSES"),
    ("autoscaling", {"maxReplicas": 2, "target": 1, "prometheus": {"serverAddress": PROMETHEUS + "@evil.example"}},
     "PrometheusAddressNotAllowed", "GEMMA_OPERATOR_ALLOWED_PROMETHEUS_ADDRESSES"),
])
def test_what_falls_outside_the_allowlists_fails_without_a_deployment(kube, ns, operator, field, value, reason, named):
    create(kube, ns, "deny", {"model": model(), "accelerator": CPU, field: value})
    obj = wait_phase(kube, ns, "deny", "Failed", operator)
    deg = condition(obj, "Degraded")
    assert deg["reason"] == reason and named in deg["message"], deg
    assert kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments")["items"] == []


def test_an_object_that_is_not_its_child_is_left_alone_with_a_condition(kube, ns, operator):
    # Someone else's Service already has the name the server's Service would take.
    theirs = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "taken", "labels": {"team": "other"}},
              "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}}
    made = kube.request("POST", f"/api/v1/namespaces/{ns}/services", theirs)
    create(kube, ns, "taken", {"model": model(), "accelerator": CPU})
    obj = wait_for(lambda: o if condition(o := get(kube, ns, "taken"), "Degraded").get("reason") == "ChildConflict"
                   else None, what="a ChildConflict condition", diagnose=operator.tail)
    message = condition(obj, "Degraded")["message"]
    assert message.startswith("Service taken already exists and is not this GemmaRustServer's (it has no controller)")
    service = kube.request("GET", f"/api/v1/namespaces/{ns}/services/taken")
    assert service["metadata"]["uid"] == made["metadata"]["uid"]
    assert service["spec"]["selector"] == {"app": "theirs"} and "ownerReferences" not in service["metadata"]
    # Its own children that do not clash are made as usual.
    deployment = kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/taken")
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
