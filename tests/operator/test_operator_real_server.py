"""The operator reading a real `python -m gemma_server` (the real engine on the tiny chat checkpoint, on CPU).

kwok pods have no process, so the server runs on loopback and the pod points the operator's poller at it
with the test-only annotation `gemmarust.dev/engine-url-for-tests`. This checks the operator against the
server's actual /v1/engine document, not a copy of its shape. The server runs with an API key, as one made
with `spec.server.apiKeySecret` does: the operator holds no Secret and must not need it.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from gemma_operator.poller import TEST_URL_ANNOTATION
from tests.cluster.controlplane import BOOT_ANNOTATION

from .harness import create, gemma_server, get, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

API_KEY = "test-key-the-operator-never-sees"


@pytest.fixture(scope="module")
def real_server(chat_checkpoint, tmp_path_factory):  # chat_checkpoint: tests/checkpoints/fixtures.py
    with gemma_server(chat_checkpoint, tmp_path_factory.mktemp("gemma_server"), api_key=API_KEY) as url:
        yield url


def test_real_server_boot_stages_reach_the_status(kube, ns, operator, real_server):
    create(kube, ns, "real", {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"},
                              "podAnnotations": {BOOT_ANNOTATION: "hold-unready", TEST_URL_ANNOTATION: real_server}})

    def reported():
        pods = (get(kube, ns, "real").get("status") or {}).get("pods") or []
        return pods and pods[0].get("engineStage") == "serving" and pods[0]
    pod = wait_for(reported, what="the real server's boot report in status", diagnose=operator.tail)
    names = [s["stage"] for s in pod["stages"]]
    assert {"import", "smoke", "weights", "warmup"} <= set(names), pod["stages"]
    done = {s["stage"]: s for s in pod["stages"]}
    for stage in ("import", "smoke", "weights", "warmup"):
        assert done[stage]["status"] == "ok" and done[stage]["seconds"] > 0, pod["stages"]
    # Serving but the (kwok-held) pod is not Ready: the last step before Ready.
    assert get(kube, ns, "real")["status"]["phase"] == "WarmingUp"


def test_real_server_served_model_reaches_the_status(kube, ns, operator, real_server):
    create(kube, ns, "real-ready", {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"},
                                    "podAnnotations": {TEST_URL_ANNOTATION: real_server}})
    obj = wait_for(lambda: o if (o := get(kube, ns, "real-ready")).get("status", {}).get("servedModel") else None,
                   what="servedModel from the real /v1/engine", diagnose=operator.tail)
    assert obj["status"]["servedModel"] == "gemma-tiny"
    with pytest.raises(urllib.error.HTTPError) as refused:  # the API itself is closed without the key
        urllib.request.urlopen(real_server + "/v1/models", timeout=5)
    assert refused.value.code == 401
    assert obj["status"]["phase"] == "Ready"
