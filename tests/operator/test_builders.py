"""Golden-dict tests of the pure builders (operator/gemma_operator/builders.py): no cluster involved."""

from __future__ import annotations

import re

import pydantic
import pytest

from gemma_operator import builders as b
from gemma_operator.spec import parse_spec

META = b.Meta("gemma", "serving", "0d9b6a3c-5f1e-4c2a-9b7e-2f4c1a8e6d10")
LABELS = {
    "app.kubernetes.io/name": "gemma-rust-server",
    "app.kubernetes.io/instance": "gemma",
    "app.kubernetes.io/component": "model-server",
    "app.kubernetes.io/part-of": "gemma-rust-operator",
    "app.kubernetes.io/managed-by": "gemma-rust-operator",
    "gemmarust.dev/server": "gemma",
}
SELECTOR = {"app.kubernetes.io/name": "gemma-rust-server", "app.kubernetes.io/instance": "gemma"}


def tpu_spec(**overrides):
    spec = {
        "model": {"source": "gs://weights-bucket/gemma-4-e2b", "embeddingTwin": "gs://weights-bucket/emb-int4",
                  "tokenSecret": {"name": "hf-token"}},
        "accelerator": {"topology": "2x2", "provisioning": "spot"},
        "image": "example.com/gemma-server:1.2.3",
        "engine": {"context": 4096},
        "server": {"servedModelName": "gemma-4", "shutdownTimeoutSeconds": 20, "startupTimeoutSeconds": 1800},
        "resources": {"requests": {"cpu": 8, "memory": "64Gi"}},
        "podAnnotations": {"team": "search"},
    }
    spec.update(overrides)
    return parse_spec(spec)


def test_tpu_deployment_matches_golden():
    assert b.build_deployment(tpu_spec(), META) == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": SELECTOR},
            "strategy": {"type": "Recreate"},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 2400,
            "template": {
                "metadata": {"labels": LABELS,
                             "annotations": {"team": "search", "gke-gcsfuse/volumes": "true"}},
                "spec": {
                    "containers": [{
                        "name": "server",
                        "image": "example.com/gemma-server:1.2.3",
                        "command": ["python", "-m", "gemma_server"],
                        "env": [
                            {"name": "GEMMA_MODEL", "value": "gs://weights-bucket/gemma-4-e2b"},
                            {"name": "GEMMA_EMB", "value": "gs://weights-bucket/emb-int4"},
                            {"name": "GEMMA_DEVICE", "value": "tpu"},
                            {"name": "GEMMA_DEVICES", "value": "4"},
                            {"name": "GEMMA_CONTEXT", "value": "4096"},
                            {"name": "GEMMA_MAX_NUM_SEQS", "value": "8"},
                            {"name": "GEMMA_PREFILL_CHUNK", "value": "256"},
                            {"name": "GEMMA_READ_EVERY", "value": "4"},
                            {"name": "GEMMA_DTYPE", "value": "bfloat16"},
                            {"name": "GEMMA_SERVED_MODEL_NAME", "value": "gemma-4"},
                            {"name": "GEMMA_PORT", "value": "8000"},
                            {"name": "GEMMA_PROBE_PORT", "value": "8001"},
                            {"name": "GEMMA_QUEUE_LIMIT", "value": "64"},
                            {"name": "GEMMA_SHUTDOWN_TIMEOUT", "value": "20"},
                            {"name": "GEMMA_BUILD_CACHE", "value": "/var/cache/gemma/build"},
                            {"name": "GEMMA_TPU_COMPILE_CACHE", "value": "/var/cache/gemma/tpu-compile"},
                            {"name": "GEMMA_GCS_ROOT", "value": "/gcs"},
                            {"name": "HF_HOME", "value": "/var/cache/gemma/hf"},
                            {"name": "TORCH_TPU_DEFER_AND_FUSE", "value": "1"},
                            {"name": "PYTHONUNBUFFERED", "value": "1"},
                            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}},
                        ],
                        "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                                  {"name": "probes", "containerPort": 8001, "protocol": "TCP"}],
                        "startupProbe": {"httpGet": {"path": "/health", "port": "probes"}, "periodSeconds": 10,
                                         "timeoutSeconds": 5, "failureThreshold": 180},
                        "readinessProbe": {"httpGet": {"path": "/health", "port": "probes"}, "periodSeconds": 5,
                                           "timeoutSeconds": 3, "failureThreshold": 3},
                        "livenessProbe": {"httpGet": {"path": "/live", "port": "probes"}, "periodSeconds": 10,
                                          "timeoutSeconds": 5, "failureThreshold": 6},
                        # Spot: a 2 s preStop, so that preStop + drain fit what a reclaimed node gives.
                        "lifecycle": {"preStop": {"sleep": {"seconds": 2}}},
                        "resources": {"requests": {"cpu": "8", "memory": "64Gi", "google.com/tpu": "4"},
                                      "limits": {"google.com/tpu": "4"}},
                        "volumeMounts": [
                            {"name": "build-cache", "mountPath": "/var/cache/gemma"},
                            {"name": "tmp", "mountPath": "/tmp"},
                            {"name": "model", "mountPath": "/gcs/weights-bucket", "readOnly": True},
                            {"name": "dshm", "mountPath": "/dev/shm"},
                        ],
                        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}},
                        "terminationMessagePath": "/dev/termination-log",
                        "terminationMessagePolicy": "FallbackToLogsOnError",
                    }],
                    "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                     "cloud.google.com/gke-tpu-topology": "2x2",
                                     "cloud.google.com/gke-spot": "true"},
                    "tolerations": [
                        {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                         "effect": "NoSchedule"},
                    ],
                    "volumes": [
                        {"name": "build-cache", "emptyDir": {"sizeLimit": "20Gi"}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
                        {"name": "model", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "readOnly": True,
                                                  "volumeAttributes": {"bucketName": "weights-bucket",
                                                                       "mountOptions": b.GCSFUSE_MOUNT_OPTIONS,
                                                                       "fileCacheCapacity": "14745Mi"}}},
                        # The GCS FUSE sidecar's file cache, bounded (16Gi by default, in memory).
                        {"name": "gke-gcsfuse-cache", "emptyDir": {"sizeLimit": "16Gi", "medium": "Memory"}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    ],
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                                        "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
                    "terminationGracePeriodSeconds": 25,  # preStop 2 + drain 20 + 3
                    "enableServiceLinks": False,
                },
            },
        },
    }


def test_cpu_deployment_uses_rolling_update_and_no_tpu_scheduling():
    spec = parse_spec({"model": {"source": "hf://google/gemma-4-e2b-it@main"}, "accelerator": {"type": "cpu"},
                       "replicas": 2, "engine": {"deferAndFuse": False}, "serviceAccountName": "reader",
                       "nodeSelector": {"pool": "big"}, "tolerations": [{"key": "x", "operator": "Exists"}]})
    dep = b.build_deployment(spec, META)
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert dep["spec"]["replicas"] == 2
    assert pod["nodeSelector"] == {"pool": "big"}
    assert pod["tolerations"] == [{"key": "x", "operator": "Exists"}]
    assert pod["serviceAccountName"] == "reader"
    assert pod["volumes"] == [{"name": "build-cache", "emptyDir": {"sizeLimit": "20Gi"}},
                              {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]
    assert dep["spec"]["template"]["metadata"]["annotations"] == {}
    c = pod["containers"][0]
    assert c["resources"] == {}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["GEMMA_MODEL"] == "hf://google/gemma-4-e2b-it@main"
    assert env["GEMMA_DEVICE"] == "cpu"
    assert env["TORCH_TPU_DEFER_AND_FUSE"] == "0"
    assert "HF_TOKEN" not in env and "GEMMA_EMB" not in env and "GEMMA_SERVED_MODEL_NAME" not in env
    assert "GEMMA_GCS_ROOT" not in env
    assert "GEMMA_DEVICES" not in env and "GEMMA_API_KEY" not in env  # one engine on CPU; the API is open
    assert "GEMMA_TPU_COMPILE_CACHE" not in env  # torch_tpu's compilation cache: TPU pods only


@pytest.mark.parametrize("topology,chips", [(None, "1"), ("1x1", "1"), ("2x2", "4"), ("2x4", "8")])
def test_tpu_chips_follow_topology(topology, chips):
    accel = {"topology": topology} if topology else {}
    dep = b.build_deployment(parse_spec({"model": {"source": "hf://a/b"}, "accelerator": accel}), META)
    pod = dep["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {"requests": {"google.com/tpu": chips},
                                                 "limits": {"google.com/tpu": chips}}
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == (topology or "1x1")
    # One engine per chip: the server starts as many as GEMMA_DEVICES says.
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["GEMMA_DEVICES"] == chips


def test_api_key_secret_reaches_the_server_only_through_a_secret_key_ref():
    spec = parse_spec({"model": {"source": "hf://a/b"}, "server": {"apiKeySecret": {"name": "gemma-api"}}})
    env = b.build_deployment(spec, META)["spec"]["template"]["spec"]["containers"][0]["env"]
    (entry,) = [e for e in env if e["name"] == "GEMMA_API_KEY"]
    assert entry == {"name": "GEMMA_API_KEY", "valueFrom": {"secretKeyRef": {"name": "gemma-api", "key": "api-key"}}}


def test_flex_start_and_compute_class_selectors():
    flex = b.node_selector(parse_spec({"model": {"source": "hf://a/b"},
                                       "accelerator": {"provisioning": "flex-start"}}))
    assert flex == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                    "cloud.google.com/gke-tpu-topology": "1x1", "cloud.google.com/gke-flex-start": "true"}
    cc = b.node_selector(parse_spec({"model": {"source": "hf://a/b"}, "accelerator": {"computeClass": "tpu-first"}}))
    assert cc["cloud.google.com/compute-class"] == "tpu-first"


def test_pvc_model_source_and_pvc_build_cache():
    spec = parse_spec({"model": {"source": "pvc://models/gemma/e2b"},
                       "buildCache": {"type": "pvc", "size": "50Gi", "storageClassName": "premium-rwo"}})
    dep = b.build_deployment(spec, META)
    pod = dep["spec"]["template"]["spec"]
    assert pod["volumes"] == [
        {"name": "build-cache", "persistentVolumeClaim": {"claimName": "gemma-build-cache-0d9b6a3c"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["GEMMA_MODEL"] == "/models/pvc/models/gemma/e2b"
    assert b.build_build_cache_pvc(spec, META) == {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "gemma-build-cache-0d9b6a3c", "namespace": "serving", "labels": LABELS},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "50Gi"}},
                 "storageClassName": "premium-rwo"},
    }


def test_the_build_cache_claim_is_named_after_the_uid_so_a_name_cannot_aim_at_an_existing_claim():
    # Two servers named alike in turn (the second after the first was deleted) get different claims, and
    # no spec names the claim: `ci` does not become `ci-build-cache`.
    first, second = b.Meta("ci", "ns", "a1b2c3d4-0000"), b.Meta("ci", "ns", "e5f6a7b8-0000")
    assert b.build_cache_claim_name(first) == "ci-build-cache-a1b2c3d4"
    assert b.build_cache_claim_name(second) == "ci-build-cache-e5f6a7b8"
    assert b.legacy_build_cache_claim_name(first) == "ci-build-cache"
    with pytest.raises(ValueError, match="uid"):
        b.build_cache_claim_name(b.Meta("ci", "ns"))


@pytest.mark.parametrize("name", ["a" * 63, "a" * 41 + ".b" * 5, "a" * 41 + "-b" * 5])
def test_a_long_name_is_cut_so_the_claim_name_stays_a_dns_label(name):
    claim = b.build_cache_claim_name(b.Meta(name, "ns", "a1b2c3d4-0000"))
    assert len(claim) <= 63 and claim.endswith("-build-cache-a1b2c3d4")
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", claim) and ".-" not in claim


def test_a_legacy_claim_this_server_owns_stays_its_build_cache():
    spec = parse_spec({"model": {"source": "hf://o/m"}, "buildCache": {"type": "pvc"}})
    legacy = META._replace(legacy_build_cache=True)
    assert b.build_build_cache_pvc(spec, legacy)["metadata"]["name"] == "gemma-build-cache"
    assert b.claims(b.build_deployment(spec, legacy)) == {"gemma-build-cache"}
    assert b.claims(b.build_deployment(spec, META)) == {"gemma-build-cache-0d9b6a3c"}
    pvc_source = parse_spec({"model": {"source": "pvc://weights/x"}, "buildCache": {"type": "pvc"}})
    assert b.claims(b.build_deployment(pvc_source, META)) == {"weights", "gemma-build-cache-0d9b6a3c"}


def test_sourced_tolerations_name_the_field_each_comes_from():
    spec = tpu_spec(tolerations=[{"key": "dedicated", "operator": "Exists"}])
    assert [source for source, _ in b.sourced_tolerations(spec)] == [
        "spec.accelerator.type", "spec.accelerator.provisioning", "spec.tolerations[0]"]
    assert [t for _, t in b.sourced_tolerations(spec)] == b.tolerations(spec)


def test_service_matches_golden():
    assert b.build_service(tpu_spec(server={"port": 9000}), META) == {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"type": "ClusterIP", "selector": SELECTOR,
                 "ports": [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]},
    }


def test_pdb_only_above_one_replica():
    assert b.build_pdb(tpu_spec(), META) is None
    assert b.build_pdb(tpu_spec(replicas=3), META) == {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": SELECTOR}},
    }


def test_pod_monitoring_and_service_monitor_match_golden():
    spec = tpu_spec(monitoring={"serviceMonitor": True, "interval": "15s"})
    endpoints = [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert b.build_pod_monitoring(spec, META) == {
        "apiVersion": "monitoring.googleapis.com/v1", "kind": "PodMonitoring",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"selector": {"matchLabels": SELECTOR}, "endpoints": endpoints},
    }
    assert b.build_service_monitor(spec, META) == {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"selector": {"matchLabels": SELECTOR}, "endpoints": endpoints},
    }
    assert b.build_service_monitor(tpu_spec(), META) is None


def test_children_skip_monitoring_kinds_the_cluster_does_not_serve():
    spec = tpu_spec(monitoring={"serviceMonitor": True}, replicas=1)
    kids = b.build_children(spec, META, frozenset({"monitoring.coreos.com/v1"}))
    assert [o["kind"] for o in kids.apply] == ["Deployment", "Service", "ServiceMonitor"]
    assert kids.absent == [("policy/v1", "PodDisruptionBudget", "gemma")]
    assert kids.skipped == [("PodMonitoring", "monitoring.googleapis.com/v1 is not served by this cluster: CRD "
                                              "podmonitorings.monitoring.googleapis.com is not installed (install "
                                              "GKE managed Prometheus)")]
    assert kids.optional == {"Monitoring": ["PodMonitoring", "ServiceMonitor"]}


def test_children_mark_switched_off_monitoring_for_deletion():
    spec = tpu_spec(monitoring={"podMonitoring": False}, replicas=2)
    kids = b.build_children(spec, META, frozenset({"monitoring.googleapis.com/v1", "monitoring.coreos.com/v1"}))
    assert [o["kind"] for o in kids.apply] == ["Deployment", "Service", "PodDisruptionBudget"]
    assert kids.absent == [("monitoring.googleapis.com/v1", "PodMonitoring", "gemma"),
                           ("monitoring.coreos.com/v1", "ServiceMonitor", "gemma")]
    assert kids.skipped == []


def test_adopt_sets_a_controller_owner_reference_without_mutating():
    child = b.build_service(tpu_spec(), META)
    owner = {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
             "metadata": {"name": "gemma", "uid": "1234"}}
    adopted = b.adopt(child, owner)
    assert adopted["metadata"]["ownerReferences"] == [
        {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer", "name": "gemma", "uid": "1234",
         "controller": True, "blockOwnerDeletion": True}]
    assert "ownerReferences" not in child["metadata"]


def test_foreign_names_why_an_object_is_not_this_servers_child():
    def existing(*refs):
        return {"metadata": {"name": "gemma", "ownerReferences": list(refs)}}
    ours = {"kind": "GemmaRustServer", "name": "gemma", "uid": "1234", "controller": True}
    assert b.foreign(None, "1234") is None
    assert b.foreign(existing(ours), "1234") is None
    assert b.foreign(existing(), "1234") == "it has no controller"
    assert b.foreign(existing({**ours, "controller": False}), "1234") == "it has no controller"
    assert b.foreign(existing({"kind": "ReplicaSet", "name": "web", "uid": "9", "controller": True}), "1234") == (
        "its controller is ReplicaSet web")
    # Same name and kind, but another (deleted and re-created) GemmaRustServer's.
    assert b.foreign(existing({**ours, "uid": "5678"}), "1234") == "its controller is GemmaRustServer gemma"


def test_endpoint_and_selector_string():
    assert b.endpoint(tpu_spec(), META) == "http://gemma.serving.svc.cluster.local:8000/v1"
    assert b.selector_string(META) == "app.kubernetes.io/instance=gemma,app.kubernetes.io/name=gemma-rust-server"


def test_cpu_with_a_read_write_once_build_cache_recreates():
    # A new pod on another node could never attach the volume; a rolling update would wait forever.
    cpu = {"model": {"source": "hf://o/m"}, "accelerator": {"type": "cpu"}}
    rwo = parse_spec({**cpu, "buildCache": {"type": "pvc", "accessMode": "ReadWriteOnce"}})
    rwx = parse_spec({**cpu, "buildCache": {"type": "pvc", "accessMode": "ReadWriteMany"}})
    assert b.build_deployment(rwo, META)["spec"]["strategy"] == {"type": "Recreate"}
    assert b.build_deployment(rwx, META)["spec"]["strategy"]["type"] == "RollingUpdate"


@pytest.mark.parametrize("field", ["source", "embeddingTwin"])
def test_a_model_source_of_no_known_form_is_refused_by_the_parser_too(field):
    # Admission refuses it with the CEL rule; an object stored before that rule must still become an
    # InvalidSpec condition (handlers catch the ValidationError), not a handler failing on every retry.
    model = {"source": "hf://o/m", field: "foo"}
    with pytest.raises(pydantic.ValidationError, match="model source must be hf://org/repo"):
        parse_spec({"model": model})


# ---------------------------------------------------------------------------------------------------------
# Capacity classes


def pod_of(**spec):
    return b.build_deployment(parse_spec({"model": {"source": "hf://o/m"}, **spec}), META)["spec"]["template"]["spec"]


def test_standard_capacity_requires_a_node_that_is_not_spot_flex_start_or_preemptible():
    assert pod_of()["affinity"] == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "cloud.google.com/gke-spot", "operator": "NotIn", "values": ["true"]},
            {"key": "cloud.google.com/gke-flex-start", "operator": "NotIn", "values": ["true"]},
            {"key": "cloud.google.com/gke-preemptible", "operator": "NotIn", "values": ["true"]}]}]}}}
    for accel in ({"provisioning": "spot"}, {"provisioning": "flex-start"}, {"computeClass": "tpu-any"}):
        assert "affinity" not in pod_of(accelerator=accel), accel


@pytest.mark.parametrize("provisioning,timeout,plan", [
    ("standard", None, (5, 30, 50)), ("standard", 120, (5, 120, 140)),
    ("spot", None, (2, 10, 15)), ("flex-start", None, (2, 10, 15)), ("spot", 30, (2, 30, 35))])
def test_prestop_and_drain_follow_the_capacity_class(provisioning, timeout, plan):
    server = {"shutdownTimeoutSeconds": timeout} if timeout else {}
    pod = pod_of(accelerator={"provisioning": provisioning}, server=server)
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    got = (c["lifecycle"]["preStop"]["sleep"]["seconds"], int(env["GEMMA_SHUTDOWN_TIMEOUT"]),
           pod["terminationGracePeriodSeconds"])
    assert got == plan


def test_a_drain_longer_than_a_reclaimed_node_gives_is_a_warning():
    spec = parse_spec({"model": {"source": "hf://o/m"}, "accelerator": {"provisioning": "spot"},
                       "server": {"shutdownTimeoutSeconds": 30}, "buildCache": {"type": "pvc"}})
    ((reason, message),) = b.spec_warnings(spec)
    assert reason == "DrainExceedsReclaimGrace"
    assert message.startswith("spec.server.shutdownTimeoutSeconds 30 s plus the 2 s preStop does not fit the 15 s")
    assert "set it to 10 or less" in message
    fits = parse_spec({"model": {"source": "hf://o/m"}, "accelerator": {"provisioning": "spot"},
                       "server": {"shutdownTimeoutSeconds": 10}, "buildCache": {"type": "pvc"}})
    assert b.spec_warnings(fits) == []


def test_an_ephemeral_build_cache_on_reclaimable_capacity_is_a_warning_not_on_standard():
    for provisioning in ("spot", "flex-start"):
        ((reason, message),) = b.spec_warnings(parse_spec({"model": {"source": "hf://o/m"},
                                                           "accelerator": {"provisioning": provisioning}}))
        assert reason == "EphemeralBuildCache"
        assert f"emptyDir on {provisioning} capacity" in message and "spec.buildCache.type: pvc" in message
        assert "torch_tpu's programs (boot stage warmup)" in message  # its compilation cache is on that volume
    assert b.spec_warnings(parse_spec({"model": {"source": "hf://o/m"}})) == []
    ((_, cpu_message),) = b.spec_warnings(parse_spec({"model": {"source": "hf://o/m"},
                                                      "accelerator": {"type": "cpu", "provisioning": "spot"}}))
    assert "torch_tpu" not in cpu_message


def test_tpu_compilation_cache_is_on_the_build_cache_volume():
    spec = parse_spec({"model": {"source": "hf://o/m"}, "buildCache": {"type": "pvc"}})
    container = b.build_deployment(spec, META)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    (cache_mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "build-cache"]
    assert env["GEMMA_TPU_COMPILE_CACHE"] == cache_mount + "/tpu-compile"
    assert env["GEMMA_BUILD_CACHE"] == cache_mount + "/build"
    assert env["TORCH_TPU_DEFER_AND_FUSE"] == "1"  # spec.engine.deferAndFuse defaults to true


def test_batch_slots_and_prefill_chunk_reach_the_server_and_out_of_range_values_are_refused():
    spec = parse_spec({"model": {"source": "hf://o/m"}, "engine": {"maxNumSeqs": 32, "prefillChunk": 64}})
    container = b.build_deployment(spec, META)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["GEMMA_MAX_NUM_SEQS"], env["GEMMA_PREFILL_CHUNK"]) == ("32", "64")
    for field in ("maxNumSeqs", "prefillChunk"):
        with pytest.raises(pydantic.ValidationError, match=field):
            parse_spec({"model": {"source": "hf://o/m"}, "engine": {field: 0}})


# ---------------------------------------------------------------------------------------------------------
# GCS FUSE and /dev/shm


def test_gcs_file_cache_is_bounded_on_its_own_volume_of_the_chosen_medium():
    pod = pod_of(model={"source": "gs://bkt/m", "gcsFuse": {"fileCacheSize": "40Gi", "fileCacheMedium": "Disk"}},
                 accelerator={"type": "cpu"})
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["gke-gcsfuse-cache"] == {"name": "gke-gcsfuse-cache", "emptyDir": {"sizeLimit": "40Gi"}}
    attrs = volumes["model"]["csi"]["volumeAttributes"]
    assert attrs["fileCacheCapacity"] == "36864Mi"  # 40 GiB less a tenth
    assert "max-size-mb" not in attrs["mountOptions"]
    # The sidecar mounts the cache volume, not the server.
    assert "gke-gcsfuse-cache" not in {m["name"] for m in pod["containers"][0]["volumeMounts"]}


def test_no_gcs_cache_volume_without_a_gs_source_and_dev_shm_only_on_tpu():
    tpu = {v["name"] for v in pod_of()["volumes"]}
    cpu = {v["name"] for v in pod_of(accelerator={"type": "cpu"})["volumes"]}
    assert tpu == {"build-cache", "tmp", "dshm"} and cpu == {"build-cache", "tmp"}
@pytest.mark.parametrize("field", ["source", "embeddingTwin"])
@pytest.mark.parametrize("source", ["pvc://claim/../../var/run/secrets", "gs://bucket/a/..", "hf://o/m@main/../x",
                                    "pvc://claim/.."])
def test_a_parent_segment_in_a_model_source_is_refused_by_the_parser_too(field, source):
    with pytest.raises(pydantic.ValidationError, match="must not contain '..' path segments"):
        parse_spec({"model": {"source": "hf://o/m", field: source}})


def test_dots_inside_a_name_are_not_a_parent_segment():
    spec = parse_spec({"model": {"source": "pvc://claim/gemma..v2/x", "embeddingTwin": "gs://bucket/a..b"}})
    assert spec.model.source == "pvc://claim/gemma..v2/x"


# ---------------------------------------------------------------------------------------------------------
# Autoscaling and the InferencePool

SCALE_TARGET = {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer", "name": "gemma"}
EVERYTHING = frozenset(row.api_version for row in b.OPTIONAL_KINDS)


def scaling(**autoscaling):
    return tpu_spec(accelerator={"type": "cpu"}, autoscaling={"maxReplicas": 4, "target": 4, **autoscaling},
                    monitoring={"podMonitoring": False})


def test_hpa_scales_the_server_on_the_pods_metric_prometheus_adapter_serves():
    assert b.build_hpa(scaling(minReplicas=2), META) == {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"scaleTargetRef": SCALE_TARGET, "minReplicas": 2, "maxReplicas": 4,
                 "metrics": [{"type": "Pods", "pods": {"metric": {"name": "gemma_num_requests_waiting"},
                                                       "target": {"type": "AverageValue", "averageValue": "4"}}}]},
    }


def test_hpa_names_the_metric_as_gkes_adapter_does_and_a_fraction_in_milli_units():
    hpa = b.build_hpa(scaling(metric="kvCacheUsage", target=0.75, metricsAdapter="GKE"), META)
    assert hpa["spec"]["metrics"][0]["pods"] == {
        "metric": {"name": "prometheus.googleapis.com|gemma_kv_cache_usage_perc|gauge"},
        "target": {"type": "AverageValue", "averageValue": "750m"}}


def test_scaled_object_queries_prometheus_for_the_servers_pods():
    spec = scaling(metric="requestsRunning", target=8,
                   prometheus={"serverAddress": "http://prometheus.monitoring.svc:9090", "authenticationRef": "gmp"})
    assert b.build_scaled_object(spec, META) == {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"scaleTargetRef": SCALE_TARGET, "minReplicaCount": 1, "maxReplicaCount": 4,
                 "triggers": [{"type": "prometheus", "metadata": {
                     "serverAddress": "http://prometheus.monitoring.svc:9090",
                     "query": 'sum(gemma_num_requests_running{namespace="serving",pod=~"gemma-[a-z0-9]+-[a-z0-9]+"})',
                     "threshold": "8"}, "authenticationRef": {"name": "gmp"}}]},
    }


def test_inference_pool_selects_the_pods_on_the_server_port_and_names_the_picker():
    spec = tpu_spec(server={"port": 9000}, gateway={"inferencePool": True, "endpointPicker": {"name": "epp"}})
    assert b.build_inference_pool(spec, META) == {
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "gemma", "namespace": "serving", "labels": LABELS},
        "spec": {"selector": {"matchLabels": SELECTOR}, "targetPorts": [{"number": 9000}],
                 "endpointPickerRef": {"name": "epp", "group": "", "kind": "Service", "port": {"number": 9002},
                                       "failureMode": "FailClose"}},
    }


def kinds(children):
    return [o["kind"] for o in children.apply]


def test_keda_is_chosen_when_served_and_given_an_address_and_our_hpa_is_pruned():
    spec = scaling(prometheus={"serverAddress": "http://p:9090"})
    kids = b.build_children(spec, META, EVERYTHING)
    assert kinds(kids)[-1] == "ScaledObject"
    # Replaced, not merely absent: deleted on every sync, since an HPA left from before KEDA's CRD appeared
    # would drive the replicas beside KEDA's own.
    assert kids.replaced == [("autoscaling/v2", "HorizontalPodAutoscaler", "gemma")]
    assert ("autoscaling/v2", "HorizontalPodAutoscaler", "gemma") not in kids.absent
    assert kids.optional == {"ScalingActive": ["ScaledObject"]} and kids.skipped == []


def test_without_kedas_crd_auto_falls_back_to_an_hpa_and_skips_nothing():
    spec = scaling(prometheus={"serverAddress": "http://p:9090"})
    kids = b.build_children(spec, META, frozenset({"autoscaling/v2"}))
    assert kinds(kids)[-1] == "HorizontalPodAutoscaler"
    assert kids.optional == {"ScalingActive": ["HorizontalPodAutoscaler"]} and kids.skipped == []


def test_auto_without_a_prometheus_address_uses_an_hpa_even_with_keda():
    kids = b.build_children(scaling(), META, EVERYTHING)
    assert kinds(kids)[-1] == "HorizontalPodAutoscaler"
    assert ("keda.sh/v1alpha1", "ScaledObject", "gemma") in kids.absent


def test_provider_keda_without_its_crd_is_skipped_naming_the_crd():
    spec = scaling(provider="KEDA", prometheus={"serverAddress": "http://p:9090"})
    kids = b.build_children(spec, META, frozenset({"autoscaling/v2"}))
    assert "HorizontalPodAutoscaler" not in kinds(kids) and "ScaledObject" not in kinds(kids)
    assert kids.skipped == [("ScaledObject", "keda.sh/v1alpha1 is not served by this cluster: CRD "
                                             "scaledobjects.keda.sh is not installed (install KEDA)")]
    assert ("autoscaling/v2", "HorizontalPodAutoscaler", "gemma") in kids.absent


def test_removing_autoscaling_and_the_pool_prunes_their_objects():
    kids = b.build_children(tpu_spec(monitoring={"podMonitoring": False}), META, EVERYTHING)
    assert {("keda.sh/v1alpha1", "ScaledObject", "gemma"), ("autoscaling/v2", "HorizontalPodAutoscaler", "gemma"),
            ("inference.networking.k8s.io/v1", "InferencePool", "gemma")} <= set(kids.absent)
    assert kids.optional == {}


def test_inference_pool_without_its_crd_is_skipped_naming_the_crd():
    spec = tpu_spec(gateway={"inferencePool": True, "endpointPicker": {"name": "epp"}})
    kids = b.build_children(spec, META, frozenset())
    assert ("InferencePool", "inference.networking.k8s.io/v1 is not served by this cluster: CRD "
            "inferencepools.inference.networking.k8s.io is not installed (install the Gateway API inference "
            "extension)") in kids.skipped


@pytest.mark.parametrize("replicas,expected", [(1, 2), (3, 3), (9, 4)])
def test_deployment_replicas_follow_spec_replicas_within_the_autoscaling_bounds(replicas, expected):
    spec = scaling(minReplicas=2, maxReplicas=4)
    spec = spec.model_copy(update={"replicas": replicas})
    assert b.build_deployment(spec, META)["spec"]["replicas"] == expected
    assert b.replicas(tpu_spec(replicas=7)) == 7


def test_every_optional_row_names_its_crd_and_a_builder_of_its_own_kind():
    spec = tpu_spec(autoscaling={"maxReplicas": 4, "target": 4, "prometheus": {"serverAddress": "http://p:9090"}},
                    monitoring={"serviceMonitor": True},
                    gateway={"inferencePool": True, "endpointPicker": {"name": "e"}})
    for row in b.OPTIONAL_KINDS:
        obj = row.builder(spec, META)
        assert (obj["apiVersion"], obj["kind"]) == (row.api_version, row.kind)
        assert row.crd is None or row.crd == f"{row.plural}.{row.api_version.split('/')[0]}"


def test_event_is_built_from_the_time_and_instance_given():
    from datetime import datetime, timezone

    body = {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
            "metadata": {"name": "g", "namespace": "ns", "uid": "u1"}}
    now = datetime(2026, 1, 2, 3, 4, 5, 600000, tzinfo=timezone.utc)
    event = b.build_event(body, "Normal", "Ready", "x" * 2000, now, "op-0")
    assert event["metadata"]["name"].startswith("g.") and len(event["metadata"]["name"]) == 12
    assert event == b.build_event(body, "Normal", "Ready", "x" * 2000, now, "op-0")
    assert event["involvedObject"] == {"apiVersion": "gemmarust.dev/v1alpha1", "kind": "GemmaRustServer",
                                       "name": "g", "namespace": "ns", "uid": "u1"}
    assert (event["firstTimestamp"], event["reportingInstance"], len(event["message"])) == (
        "2026-01-02T03:04:05Z", "op-0", 1024)


@pytest.mark.parametrize("autoscaling,message", [
    ({"minReplicas": 5, "maxReplicas": 4, "target": 1}, "minReplicas must not exceed"),
    ({"maxReplicas": 4, "target": 1, "provider": "KEDA"}, "set spec.autoscaling.prometheus.serverAddress"),
    ({"maxReplicas": 4, "target": 2, "metric": "kvCacheUsage"}, "a fraction of the KV cache"),
])
def test_autoscaling_rules_are_cel_in_the_crd(autoscaling, message):
    from gemma_operator import crd

    rules = crd.spec_schema()["properties"]["autoscaling"]["x-kubernetes-validations"]
    assert any(message in r["message"] for r in rules)
