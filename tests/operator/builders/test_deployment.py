"""The Deployment and its pod (gemma_operator/builders/deployment.py): golden dicts, no cluster involved."""

from __future__ import annotations

import pydantic
import pytest

from gemma_operator.builders.deployment import (GCSFUSE_MOUNT_OPTIONS, build_deployment, node_selector, replicas,
                                                sourced_tolerations, spec_warnings, tolerations)
from gemma_operator.spec import accelerator_text, parse_spec

from .specs import LABELS, META, SELECTOR, env_of, pod_of, scaling, tpu_spec


def test_tpu_deployment_matches_golden():
    assert build_deployment(tpu_spec(), META) == {
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
                            {"name": "GEMMA_TENSOR_PARALLEL_SIZE", "value": "1"},
                            {"name": "GEMMA_CONTEXT", "value": "4096"},
                            {"name": "GEMMA_MAX_NUM_SEQS", "value": "8"},
                            {"name": "GEMMA_PREFILL_CHUNK", "value": "256"},
                            {"name": "GEMMA_READ_EVERY", "value": "4"},
                            {"name": "GEMMA_DTYPE", "value": "bfloat16"},
                            {"name": "GEMMA_COMPILE", "value": "off"},
                            {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/var/cache/gemma/inductor"},
                            {"name": "GEMMA_SERVED_MODEL_NAME", "value": "gemma-4"},
                            {"name": "GEMMA_PORT", "value": "8000"},
                            {"name": "GEMMA_PROBE_PORT", "value": "8001"},
                            {"name": "GEMMA_MCP_ALLOWED_HOSTS",
                             "value": "localhost,127.0.0.1,gemma,gemma.serving,gemma.serving.svc,"
                                      "gemma.serving.svc.cluster.local"},
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
                                  {"name": "probes", "containerPort": 8001, "protocol": "TCP"},
                                  {"name": "tpu-metrics", "containerPort": 8431, "protocol": "TCP"}],
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
                                                                       "mountOptions": GCSFUSE_MOUNT_OPTIONS,
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
    dep = build_deployment(spec, META)
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
    assert "GEMMA_TENSOR_PARALLEL_SIZE" not in env  # no chips to split the model over
    assert "GEMMA_TPU_COMPILE_CACHE" not in env  # torch_tpu's compilation cache: TPU pods only
    assert [p["name"] for p in c["ports"]] == ["http", "probes"]  # GKE's TPU metrics port: TPU pods only



@pytest.mark.parametrize("tpu", ["tpu-v5-lite-podslice", "tpu-v6e-slice"])
@pytest.mark.parametrize("topology,chips", [(None, "1"), ("1x1", "1"), ("2x2", "4"), ("2x4", "8")])
def test_tpu_chips_follow_topology(tpu, topology, chips):
    accel = {"type": tpu, **({"topology": topology} if topology else {})}
    spec = parse_spec({"model": {"source": "hf://a/b"}, "accelerator": accel})
    dep = build_deployment(spec, META)
    pod = dep["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {"requests": {"google.com/tpu": chips},
                                                 "limits": {"google.com/tpu": chips}}
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": tpu,
                                   "cloud.google.com/gke-tpu-topology": topology or "1x1"}
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    assert dep["spec"]["strategy"]["type"] == "Recreate"  # the only chips: a new pod cannot start beside the old
    short = {"tpu-v5-lite-podslice": "v5e", "tpu-v6e-slice": "v6e"}[tpu]
    assert accelerator_text(spec.accelerator) == f"{short} {topology or '1x1'}"
    # The server runs GEMMA_DEVICES / GEMMA_TENSOR_PARALLEL_SIZE engines; a model of unknown size gets no memory
    # plan, so one engine per chip.
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert (env["GEMMA_DEVICES"], env["GEMMA_TENSOR_PARALLEL_SIZE"]) == (chips, "1")


@pytest.mark.parametrize("source,accelerator,engine,n", [
    ("hf://google/gemma-4-31B-it", {"topology": "2x4"}, {}, "8"),  # the smallest size its weights fit
    ("hf://google/gemma-4-31B-it", {"type": "tpu-v6e-slice", "topology": "2x4"}, {}, "4"),
    ("hf://google/gemma-4-E2B-it", {"topology": "2x4"}, {}, "1"),  # fits one chip: eight engines
    ("hf://google/gemma-4-E2B-it", {"topology": "2x4"}, {"tensorParallelSize": 2}, "2"),  # as asked
])
def test_a_tpu_pod_gets_the_tensor_parallel_size_of_its_memory_plan(source, accelerator, engine, n):
    env = env_of(parse_spec({"model": {"source": source}, "accelerator": accelerator, "engine": engine}))
    assert (env["GEMMA_DEVICES"], env["GEMMA_TENSOR_PARALLEL_SIZE"]) == ("8", n)


def test_api_key_secret_reaches_the_server_only_through_a_secret_key_ref():
    spec = parse_spec({"model": {"source": "hf://a/b"}, "server": {"apiKeySecret": {"name": "gemma-api"}}})
    env = build_deployment(spec, META)["spec"]["template"]["spec"]["containers"][0]["env"]
    (entry,) = [e for e in env if e["name"] == "GEMMA_API_KEY"]
    assert entry == {"name": "GEMMA_API_KEY", "valueFrom": {"secretKeyRef": {"name": "gemma-api", "key": "api-key"}}}


def test_queue_limit_reaches_the_server_only_when_set():
    # Unset, the server keeps its own default (gemma_server/config.py, GEMMA_QUEUE_LIMIT), declared there once.
    assert "GEMMA_QUEUE_LIMIT" not in env_of(tpu_spec())
    assert env_of(tpu_spec(server={"queueLimit": 128}))["GEMMA_QUEUE_LIMIT"] == "128"


def test_compile_reaches_the_server_with_inductors_cache_on_the_build_cache_volume():
    assert env_of(tpu_spec())["GEMMA_COMPILE"] == "off"
    env = env_of(tpu_spec(engine={"compile": "auto"}))
    assert env["GEMMA_COMPILE"] == "auto" and env["TORCHINDUCTOR_CACHE_DIR"].startswith(env["GEMMA_BUILD_CACHE"][:-5])
    with pytest.raises(pydantic.ValidationError, match="compile"):
        tpu_spec(engine={"compile": "sometimes"})


def test_speculative_decoding_reaches_the_server_only_when_set():
    env = env_of(tpu_spec())
    assert not any(k.startswith(("GEMMA_SPECULATIVE", "GEMMA_NUM_SPECULATIVE")) for k in env)
    env = env_of(tpu_spec(engine={"speculative": {"numSpeculativeTokens": 4}}))
    assert env["GEMMA_SPECULATIVE_METHOD"] == "ngram" and env["GEMMA_NUM_SPECULATIVE_TOKENS"] == "4"
    assert "GEMMA_SPECULATIVE_MAX_BATCH" not in env  # the server's default
    env = env_of(tpu_spec(engine={"speculative": {"method": "ngram", "numSpeculativeTokens": 2, "maxBatch": 8}}))
    assert env["GEMMA_SPECULATIVE_MAX_BATCH"] == "8"
    for bad, field in (({"numSpeculativeTokens": 0}, "numSpeculativeTokens"), ({}, "numSpeculativeTokens"),
                       ({"method": "mtp", "numSpeculativeTokens": 2}, "method")):
        with pytest.raises(pydantic.ValidationError, match=field):
            tpu_spec(engine={"speculative": bad})


def test_an_mtp_drafter_is_mounted_as_the_model_is():
    mtp = {"method": "mtp", "numSpeculativeTokens": 3}
    env = env_of(tpu_spec(engine={"speculative": {**mtp, "source": "hf://google/gemma-4-E2B-it-assistant"}}))
    assert env["GEMMA_SPECULATIVE_METHOD"] == "mtp"
    assert env["GEMMA_SPECULATIVE_MODEL"] == "hf://google/gemma-4-E2B-it-assistant"
    pod = pod_of(engine={"speculative": {**mtp, "source": "pvc://drafts/e2b"}})
    server = pod["containers"][0]
    mount = next(m for m in server["volumeMounts"] if m["name"] == "model-drafter")
    assert mount == {"name": "model-drafter", "mountPath": "/models/pvc/drafts", "readOnly": True}
    assert {"name": "model-drafter", "persistentVolumeClaim": {"claimName": "drafts", "readOnly": True}} \
        in pod["volumes"]
    assert {e["name"]: e.get("value") for e in server["env"]}["GEMMA_SPECULATIVE_MODEL"] == "/models/pvc/drafts/e2b"
    # In the model's bucket: mounted once, through the GCS FUSE driver.
    spec = parse_spec({"model": {"source": "gs://weights/gemma"},
                       "engine": {"speculative": {**mtp, "source": "gs://weights/assistant"}}})
    pod = build_deployment(spec, META)["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"] if "csi" in v] == ["model"]
    assert {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}["GEMMA_SPECULATIVE_MODEL"] == \
        "gs://weights/assistant"
    for bad, message in (({**mtp}, "speculative.source is the assistant drafter of method mtp"),
                         ({"numSpeculativeTokens": 2, "source": "hf://o/d"}, "leave it unset with ngram"),
                         ({**mtp, "source": "ftp://x/y"}, "model source must be"),
                         ({**mtp, "source": "pvc://c/../x"}, "must not contain '..'")):
        with pytest.raises(pydantic.ValidationError, match=message):
            tpu_spec(engine={"speculative": bad})


def test_flex_start_and_compute_class_selectors():
    flex = node_selector(parse_spec({"model": {"source": "hf://a/b"},
                                     "accelerator": {"provisioning": "flex-start"}}))
    assert flex == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                    "cloud.google.com/gke-tpu-topology": "1x1", "cloud.google.com/gke-flex-start": "true"}
    cc = node_selector(parse_spec({"model": {"source": "hf://a/b"}, "accelerator": {"computeClass": "tpu-first"}}))
    assert cc["cloud.google.com/compute-class"] == "tpu-first"


def test_sourced_tolerations_name_the_field_each_comes_from():
    spec = tpu_spec(tolerations=[{"key": "dedicated", "operator": "Exists"}])
    assert [source for source, _ in sourced_tolerations(spec)] == [
        "spec.accelerator.type", "spec.accelerator.provisioning", "spec.tolerations[0]"]
    assert [t for _, t in sourced_tolerations(spec)] == tolerations(spec)


def test_cpu_with_a_read_write_once_build_cache_recreates():
    # A new pod on another node could never attach the volume; a rolling update would wait forever.
    cpu = {"model": {"source": "hf://o/m"}, "accelerator": {"type": "cpu"}}
    rwo = parse_spec({**cpu, "buildCache": {"type": "pvc", "accessMode": "ReadWriteOnce"}})
    rwx = parse_spec({**cpu, "buildCache": {"type": "pvc", "accessMode": "ReadWriteMany"}})
    assert build_deployment(rwo, META)["spec"]["strategy"] == {"type": "Recreate"}
    assert build_deployment(rwx, META)["spec"]["strategy"]["type"] == "RollingUpdate"


@pytest.mark.parametrize("field", ["source", "embeddingTwin"])
def test_a_model_source_of_no_known_form_is_refused_by_the_parser_too(field):
    # Admission refuses it with the CEL rule; an object stored before that rule must still become an
    # InvalidSpec condition (handlers catch the ValidationError), not a handler failing on every retry.
    model = {"source": "hf://o/m", field: "foo"}
    with pytest.raises(pydantic.ValidationError, match="model source must be hf://org/repo"):
        parse_spec({"model": model})


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
# Capacity classes


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
    ((reason, message),) = spec_warnings(spec)
    assert reason == "DrainExceedsReclaimGrace"
    assert message.startswith("spec.server.shutdownTimeoutSeconds 30 s plus the 2 s preStop does not fit the 15 s")
    assert "set it to 10 or less" in message
    fits = parse_spec({"model": {"source": "hf://o/m"}, "accelerator": {"provisioning": "spot"},
                       "server": {"shutdownTimeoutSeconds": 10}, "buildCache": {"type": "pvc"}})
    assert spec_warnings(fits) == []


def test_an_ephemeral_build_cache_on_reclaimable_capacity_is_a_warning_not_on_standard():
    for provisioning in ("spot", "flex-start"):
        ((reason, message),) = spec_warnings(parse_spec({"model": {"source": "hf://o/m"},
                                                         "accelerator": {"provisioning": provisioning}}))
        assert reason == "EphemeralBuildCache"
        assert f"emptyDir on {provisioning} capacity" in message and "spec.buildCache.type: pvc" in message
        assert "torch_tpu's programs (boot stage warmup)" in message  # its compilation cache is on that volume
    assert spec_warnings(parse_spec({"model": {"source": "hf://o/m"}})) == []
    ((_, cpu_message),) = spec_warnings(parse_spec({"model": {"source": "hf://o/m"},
                                                    "accelerator": {"type": "cpu", "provisioning": "spot"}}))
    assert "torch_tpu" not in cpu_message


def test_tpu_compilation_cache_is_on_the_build_cache_volume():
    spec = parse_spec({"model": {"source": "hf://o/m"}, "buildCache": {"type": "pvc"}})
    container = build_deployment(spec, META)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    (cache_mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "build-cache"]
    assert env["GEMMA_TPU_COMPILE_CACHE"] == cache_mount + "/tpu-compile"
    assert env["GEMMA_BUILD_CACHE"] == cache_mount + "/build"
    assert env["TORCH_TPU_DEFER_AND_FUSE"] == "1"  # spec.engine.deferAndFuse defaults to true
    # Pods share the PVC, so each one's torch_tpu writes its own emptyDir (gemma_server/compile_cache.py).
    (local,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "tpu-compile-local"]
    assert env["GEMMA_TPU_COMPILE_CACHE_LOCAL"].startswith(local + "/")
    volumes = {v["name"]: v for v in build_deployment(spec, META)["spec"]["template"]["spec"]["volumes"]}
    assert "sizeLimit" in volumes["tpu-compile-local"]["emptyDir"]


def test_a_pod_that_owns_its_build_cache_lets_torch_tpu_write_the_compilation_cache_itself():
    spec = parse_spec({"model": {"source": "hf://o/m"}})  # emptyDir: the pod's alone
    container = build_deployment(spec, META)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "GEMMA_TPU_COMPILE_CACHE" in env and "GEMMA_TPU_COMPILE_CACHE_LOCAL" not in env
    assert not [m for m in container["volumeMounts"] if m["name"] == "tpu-compile-local"]


def test_batch_slots_and_prefill_chunk_reach_the_server_and_out_of_range_values_are_refused():
    spec = parse_spec({"model": {"source": "hf://o/m"}, "engine": {"maxNumSeqs": 32, "prefillChunk": 64}})
    container = build_deployment(spec, META)["spec"]["template"]["spec"]["containers"][0]
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
    assert "file-cache:max-size-mb" not in attrs["mountOptions"]  # no option lifts the driver's bound
    # The sidecar mounts the cache volume, not the server.
    assert "gke-gcsfuse-cache" not in {m["name"] for m in pod["containers"][0]["volumeMounts"]}


def test_no_gcs_cache_volume_without_a_gs_source_and_dev_shm_only_on_tpu():
    tpu = {v["name"] for v in pod_of()["volumes"]}
    cpu = {v["name"] for v in pod_of(accelerator={"type": "cpu"})["volumes"]}
    assert tpu == {"build-cache", "tmp", "dshm"} and cpu == {"build-cache", "tmp"}

# ---------------------------------------------------------------------------------------------------------
# Replicas


@pytest.mark.parametrize("spec_replicas,expected", [(1, 2), (3, 3), (9, 4)])
def test_deployment_replicas_follow_spec_replicas_within_the_autoscaling_bounds(spec_replicas, expected):
    spec = scaling(minReplicas=2, maxReplicas=4)
    spec = spec.model_copy(update={"replicas": spec_replicas})
    assert build_deployment(spec, META)["spec"]["replicas"] == expected
    assert replicas(tpu_spec(replicas=7)) == 7


def test_gcs_fuse_reads_in_parallel_and_caches_metadata_for_read_only_serving():
    dep = build_deployment(parse_spec({"model": {"source": "gs://bucket/gemma", "gcsFuse": {"fileCacheSize": "20Gi"}}}),
                           META)
    (volume,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if "csi" in v]
    attributes = volume["csi"]["volumeAttributes"]
    options = dict(o.rsplit(":", 1) if ":" in o else (o, "") for o in attributes["mountOptions"].split(","))
    assert options["file-cache:enable-parallel-downloads"] == "true"
    assert options["file-cache:parallel-downloads-per-file"] == "100"
    assert options["metadata-cache:ttl-secs"] == "-1" and volume["csi"]["readOnly"] is True


def test_media_limits_reach_the_server_only_when_set():
    # Unset, the server keeps its own defaults (gemma_server/config.py), declared there once.
    assert not [k for k in env_of(tpu_spec()) if "MEDIA" in k or k.startswith(("GEMMA_MAX_IMAGE", "GEMMA_MAX_AUDIO"))]
    env = env_of(tpu_spec(server={"media": {"maxImagesPerRequest": 2, "maxImagePixels": 1048576,
                                            "maxAudioSeconds": 60, "maxMediaBytes": 2097152,
                                            "fetchHosts": ["images.example.com", "cdn.example.org"],
                                            "fetchTimeoutSeconds": 5}}))
    assert (env["GEMMA_MAX_IMAGES_PER_REQUEST"], env["GEMMA_MAX_IMAGE_PIXELS"], env["GEMMA_MAX_AUDIO_SECONDS"],
            env["GEMMA_MAX_MEDIA_BYTES"]) == ("2", "1048576", "60", "2097152")
    assert env["GEMMA_MEDIA_FETCH_HOSTS"] == "images.example.com,cdn.example.org"
    assert env["GEMMA_MEDIA_FETCH_TIMEOUT"] == "5"


def test_a_fetch_host_that_is_not_a_dns_name_is_refused_naming_it():
    with pytest.raises(ValueError, match="fetchHosts"):
        tpu_spec(server={"media": {"fetchHosts": ["http://images.example.com/"]}})
