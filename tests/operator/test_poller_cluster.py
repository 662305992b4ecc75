"""The operator process against hostile pods (FakeEngineEndpoint: a trickle, a redirect, 10 MiB, a huge failure
reason holding a token): every server's status is still written, a well-behaved server's status follows its
pod as fast as when alone, and the operator's memory stays bounded."""

from __future__ import annotations

import json
import time

import pytest

from gemma_operator.poller import MAX_REPLY_BYTES, TEST_URL_ANNOTATION
from tests.cluster.controlplane import BOOT_ANNOTATION

from .fakes import FakeEngineEndpoint
from .harness import create, dump, get, wait_for

pytestmark = pytest.mark.cluster

HF_TOKEN = "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"


def booting(url: str, replicas: int = 1) -> dict:
    return {"model": {"source": "hf://google/gemma-4-e2b-it"}, "accelerator": {"type": "cpu"}, "replicas": replicas,
            "podAnnotations": {BOOT_ANNOTATION: "hold-unready", TEST_URL_ANNOTATION: url}}


def pod_messages(kube, ns, name) -> list[str]:
    return [p.get("message", "") for p in (get(kube, ns, name).get("status") or {}).get("pods") or []]


def phase_within(kube, ns, name, phase, seconds, operator) -> float:
    start = time.monotonic()
    wait_for(lambda: (get(kube, ns, name).get("status") or {}).get("phase") == phase, timeout=seconds,
             interval=0.05, what=f"{name} phase {phase}",
             diagnose=lambda: dump(get(kube, ns, name).get("status")) + "\n" + operator.tail(30))
    return time.monotonic() - start


def test_hostile_pods_stall_no_one_bloat_nothing_and_every_status_is_written(kube, ns, operator):
    with FakeEngineEndpoint() as good, FakeEngineEndpoint() as slow, FakeEngineEndpoint() as huge, \
            FakeEngineEndpoint() as redirect, FakeEngineEndpoint() as target, FakeEngineEndpoint() as loud:
        slow.mode, huge.mode = "trickle", "huge"
        redirect.mode, redirect.redirect_to = "redirect", target.url
        loud.engine = {"stage": "smoke", "failed": f"env: HF_TOKEN={HF_TOKEN} " + "x" * (MAX_REPLY_BYTES - 200)}

        create(kube, ns, "good", booting(good.url))
        phase_within(kube, ns, "good", "Building", 45, operator)
        # How fast the good server's status follows its pod while it is the only one.
        good.boot_to("smoke", {"build": 30.0, "import": 0.5})
        alone = phase_within(kube, ns, "good", "SmokeTesting", 10, operator)
        baseline = operator.rss_bytes()

        for name, fake, replicas in (("slow", slow, 4), ("huge", huge, 4), ("redirect", redirect, 1),
                                     ("loud", loud, 1)):
            create(kube, ns, name, booting(fake.url, replicas))

        # Every hostile server gets a status that says why its pods report nothing.
        for name, why in (("slow", "no complete reply within 2 s"),
                          ("huge", f"reply over {MAX_REPLY_BYTES} bytes refused"),
                          ("redirect", "redirect refused (HTTP 302)")):
            wait_for(lambda: any(why in m for m in pod_messages(kube, ns, name)), timeout=60,
                     what=f"{name}'s poll failure in its status", diagnose=lambda: operator.tail(30))
        failed = wait_for(lambda: (lambda o: o if (o.get("status") or {}).get("phase") == "Failed" else None)(
            get(kube, ns, "loud")), timeout=60, what="loud Failed", diagnose=operator.tail)
        assert HF_TOKEN not in json.dumps(failed["status"])
        assert len(json.dumps(failed["status"])) < 8 * 1024
        assert target.requests == []  # the redirect was never followed
        wait_for(lambda: huge.requests.count("/v1/engine") >= 8 and slow.bytes_sent > 20, timeout=60,
                 what="several polls of every huge and slow pod")

        # The good server's status follows its pod about as fast as when it was alone, trickles and 10 MiB
        # replies notwithstanding (a blocking poll inside sync made this take as long as the slowest pod).
        good.boot_to("weights", {"build": 30.0, "import": 0.5, "smoke": 2.0})
        took_weights = phase_within(kube, ns, "good", "LoadingWeights", 10, operator)
        good.boot_to("warmup", {"build": 30.0, "import": 0.5, "smoke": 2.0, "weights": 9.0})
        took_warmup = phase_within(kube, ns, "good", "WarmingUp", 10, operator)
        grown = operator.rss_bytes() - baseline
        print(f"good server's status behind its pod: alone {alone:.2f}s; beside hostile pods "
              f"{took_weights:.2f}s, {took_warmup:.2f}s; operator RSS {baseline / 2**20:.0f} MiB -> "
              f"+{grown / 2**20:.1f} MiB; huge polled {huge.requests.count('/v1/engine')}x, slow trickled "
              f"{slow.bytes_sent} B")
        assert max(took_weights, took_warmup) < max(alone + 1.5, 2.5)
        assert grown < 40 * 2**20
        assert operator.alive()
