"""The server image, built from images/Dockerfile.server, booted on the CPU as the operator's pod spec runs it.

The container gets exactly what gemma_operator.builders puts in the Deployment for a CPU GemmaRustServer
whose model is a pvc:// checkpoint: its command, environment, user and groups, read-only root filesystem,
dropped capabilities, the build cache volume at /var/cache/gemma (a Docker volume, empty at first: an
emptyDir outlives a container restart, as the volume does here), a scratch /tmp, the checkpoint mounted
read-only, and the termination message file. Only the ports are picked free (spec.server.port and probePort), since the
container shares the host's network.

The first boot compiles the engine inside the container (minutes); the restart on the same volume reuses
it. Both boots' stage times are printed in the terminal summary.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from gemma_operator.builders.deployment import CACHE_MOUNT, build_deployment
from gemma_operator.builders.ownership import Meta
from gemma_operator.spec import parse_spec
from tests.checkpoints.fixtures import chat_checkpoint  # noqa: F401 - the session fixture, used below
from tests.images.conftest import BUILD_TIMEOUT, SERVER_TAG, record
from tests.images.containers import ROOT, TMPFS, Container, docker, run_args
from tests.images.test_dockerfiles import requirement_pins
from tests.server.conftest import LONG_PROMPT, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 3600)]

STAGES = ["build", "import", "smoke", "weights", "compile", "warmup", "serving"]
COLD_BOOT_TIMEOUT = 1800  # compiles the engine on two cores
WARM_BOOT_TIMEOUT = 300
CLAIM = "checkpoints"  # the pvc:// claim; its directory on the host is mounted in its place


def server_pod(model: str, port: int, probe_port: int) -> dict:
    """The pod spec the operator builds for a CPU server of the pvc:// checkpoint `model`."""
    spec = parse_spec({"model": {"source": f"pvc://{CLAIM}/{model}"}, "accelerator": {"type": "cpu"},
                       "image": SERVER_TAG, "engine": {"context": 1024, "dtype": "float32"},
                       "server": {"port": port, "probePort": probe_port, "servedModelName": "chat", "shutdownTimeoutSeconds": 30}})
    return build_deployment(spec, Meta("gemma", "default"))["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def checkpoints(chat_checkpoint, tmp_path_factory) -> Path:  # noqa: F811
    """The claim's directory: `chat` (the tiny chat checkpoint) and `missing-tensor` (the same, one tensor
    short), world-readable, since the container runs as uid 1000."""
    root = tmp_path_factory.mktemp("claim")
    shutil.copytree(chat_checkpoint, root / "chat")
    broken = shutil.copytree(chat_checkpoint, root / "missing-tensor")
    tensors = load_file(broken / "model.safetensors")
    dropped = sorted(k for k in tensors if k.endswith("self_attn.q_proj.weight"))[0]
    del tensors[dropped]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    (root / "missing-tensor" / "DROPPED").write_text(dropped)
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return root


@dataclass
class Server:
    """A server container and what its boot looked like from outside."""

    container: Container
    pod: dict
    base: str
    termination_log: Path
    samples: list[tuple[int | None, str | None]] = field(default_factory=list)  # (/health, stage)
    seconds: float = 0.0  # docker run to /health 200
    info: dict = field(default_factory=dict)  # /v1/engine once serving

    @property
    def grace(self) -> int:
        return self.pod["terminationGracePeriodSeconds"]

    def stage_times(self) -> str:
        return ", ".join(f"{s['stage']} {s['seconds']:.1f}s" for s in self.info["stages"] if s["stage"] != "serving")


class Boots:
    """Starts server containers on one build cache volume, and removes them (and the volume) at the end."""

    def __init__(self, claim: Path, tmp: Path):
        self.claim, self.tmp = claim, tmp
        self.volume = f"gemma-build-cache-{uuid.uuid4().hex[:8]}"
        self.containers: list[Container] = []

    def start(self, model: str) -> Server:
        port = free_port()
        pod = server_pod(model, port, free_port())
        n = len(self.containers)
        term = self.tmp / f"termination-log-{n}"
        term.write_text("")
        term.chmod(0o666)  # the kubelet's file is writable by the container's user
        name = f"gemma-server-test-{uuid.uuid4().hex[:8]}"
        args = run_args(pod, name=name, image=SERVER_TAG, termination_log=term,
                        volumes={"build-cache": self.volume, "tmp": TMPFS, "model": str(self.claim)})
        c = Container.run(args)
        self.containers.append(c)
        return Server(c, pod, f"http://127.0.0.1:{port}", term)

    def close(self) -> None:
        for c in self.containers:
            c.remove()
        docker("volume", "rm", "--force", self.volume, check=False)


def watch_boot(s: Server, timeout: float) -> Server:
    """Poll /health, then /v1/engine, until /health is 200; keep every sample. Fails if the container exits."""
    t0 = time.monotonic()
    while True:
        health = stage = None
        try:
            health = httpx.get(s.base + "/health", timeout=5).status_code
            stage = httpx.get(s.base + "/v1/engine", timeout=5).json()["stage"]
        except httpx.TransportError:
            pass  # the port is not open yet
        s.samples.append((health, stage))
        if health == 200:
            break
        if not s.container.running():
            pytest.fail(f"the server container exited while booting\n{s.container.tail()}")
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"no /health 200 after {timeout}s (last stage {stage})\n{s.container.tail()}")
        time.sleep(0.25)
    s.seconds = time.monotonic() - t0
    s.info = httpx.get(s.base + "/v1/engine", timeout=5).json()
    return s


@pytest.fixture(scope="module")
def boots(checkpoints, tmp_path_factory, server_image) -> Iterator[Boots]:
    b = Boots(checkpoints, tmp_path_factory.mktemp("server-image"))
    yield b
    b.close()


@pytest.fixture(scope="module")
def cold(boots) -> Server:
    """The first boot, on an empty build cache volume: it compiles the engine."""
    s = watch_boot(boots.start("chat"), COLD_BOOT_TIMEOUT)
    record(f"server container, first boot (empty build cache): /health 200 after {s.seconds:.1f}s; "
           f"{s.stage_times()}")
    return s


def installed(image: str) -> dict[str, str]:
    """{normalised distribution name: version} of what pip sees in the image."""
    out = docker("run", "--rm", "--network", "none", "--entrypoint", "python", image,
                 "-m", "pip", "list", "--format", "json").stdout
    return {re.sub(r"[-_.]+", "-", d["name"]).lower(): d["version"] for d in json.loads(out)}


def test_server_image_installs_exactly_the_pinned_requirements_and_no_engine(server_image):
    pins = requirement_pins((ROOT / "images" / "server-requirements.txt").read_text())
    have = installed(SERVER_TAG)
    assert {name: have.get(name) for name in pins} == pins
    assert have["gemma-server"] == tomllib.loads((ROOT / "server" / "pyproject.toml").read_text())["project"]["version"]
    assert "gemma-engine" not in have, "the engine is built at boot, against the image's torch"


def test_every_process_in_the_server_image_runs_on_tcmalloc(server_image):
    """LD_PRELOAD puts tcmalloc in each process (torch_tpu warns without it): the Python that serves maps it,
    and so does a compiler the boot build starts."""
    maps = docker("run", "--rm", "--network", "none", "--entrypoint", "python", SERVER_TAG, "-c",
                  "import torch; print(open('/proc/self/maps').read())").stdout
    assert "libtcmalloc_minimal.so.4" in maps
    child = docker("run", "--rm", "--network", "none", "--entrypoint", "sh", SERVER_TAG, "-c",
                   "cat /proc/self/maps").stdout
    assert "libtcmalloc_minimal.so.4" in child


def test_first_boot_runs_every_stage_and_health_turns_200_only_when_serving(cold):
    assert [(x["stage"], x["status"]) for x in cold.info["stages"]] == [
        *((stage, "skipped" if stage == "compile" else "ok") for stage in STAGES[:-1]), ("serving", "running")]
    assert cold.info["stages"][0]["message"].startswith("compiled ")
    # The build landed in the build-cache volume (the server shows no module path without --expose-paths).
    key = cold.info["stages"][0]["message"].split()[1]
    marker = f"{CACHE_MOUNT}/build/{key}/BUILD.json"
    assert docker("exec", cold.container.name, "ls", marker, check=False).returncode == 0, "not in the volume"
    assert "module" not in cold.info["build"] and "model_dir" not in cold.info
    # /health answered 503 while the engine compiled, and 200 only once the stage was `serving`.
    assert (503, "build") in cold.samples
    assert all(stage == "serving" for health, stage in cold.samples if health == 200)
    assert all(health in (None, 503) for health, stage in cold.samples if stage != "serving")


def test_openai_sdk_streams_a_chat_reply(cold):
    client = openai.OpenAI(base_url=cold.base + "/v1", api_key="unused", timeout=120)
    stream = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and finish in (["length"], ["stop"])
    assert chunks[-1].usage.completion_tokens >= 1


def test_metrics_scrape_counts_the_boot_and_the_requests(cold):
    client = openai.OpenAI(base_url=cold.base + "/v1", api_key="unused", timeout=120)
    reply = client.completions.create(model="chat", prompt="Hello", max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(cold.base + "/metrics").text)}
    stages = {s.labels["stage"]: s.value for s in families["gemma_boot_stage_seconds"].samples}
    assert stages["build"] > 0 and set(STAGES[:-1]) <= set(stages)
    assert families["gemma_engine_ready"].samples[0].value == 1
    done = {s.labels["finished_reason"]: s.value for s in families["gemma_request_success"].samples
            if s.name == "gemma_request_success_total"}
    assert done.get("length", 0) >= 1


def test_sigterm_drains_the_running_request_and_the_container_exits_0(cold):
    client = httpx.Client(timeout=120)
    req = client.build_request("POST", cold.base + "/v1/completions",
                               json={"model": "chat", "prompt": LONG_PROMPT, "max_tokens": 400, "stream": True})
    response = client.send(req, stream=True)
    assert response.status_code == 200
    events = (line for line in response.iter_lines() if line.startswith("data: "))
    next(events)
    # What the kubelet sends after the preStop hook; the server is the container's PID 1.
    docker("kill", "--signal", "TERM", cold.container.name)
    rest = list(events)
    assert rest[-1] == "data: [DONE]", rest[-3:]
    # It ends as a request ends on its own, at an eos or at max_tokens (the sampled tokens decide which);
    # a request the drain cuts gets an error event instead.
    last = json.loads(rest[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] in ("stop", "length"), f"the drained request was cut short: {rest[-2]}"
    assert cold.container.wait(cold.grace) == 0, cold.container.tail()


def test_restart_on_the_same_build_cache_reuses_the_engine(cold, boots):
    if cold.container.running():  # when run on its own
        assert cold.container.stop(cold.grace) == 0
    warm = watch_boot(boots.start("chat"), WARM_BOOT_TIMEOUT)
    record(f"server container, restart (same build cache): /health 200 after {warm.seconds:.1f}s; "
           f"{warm.stage_times()}")
    cold_build, warm_build = cold.info["stages"][0], warm.info["stages"][0]
    assert warm_build["message"] == "cached " + cold_build["message"].split()[1]
    assert warm_build["seconds"] < 60 and warm_build["seconds"] < cold_build["seconds"] / 5
    assert "maturin" not in warm.container.logs()
    assert warm.container.stop(warm.grace) == 0


def test_a_checkpoint_missing_a_tensor_fails_the_boot_with_the_reason_in_the_termination_log(boots, checkpoints):
    s = boots.start("missing-tensor")
    code = s.container.wait(COLD_BOOT_TIMEOUT)
    message = s.termination_log.read_text()
    dropped = (checkpoints / "missing-tensor" / "DROPPED").read_text()
    assert code != 0
    assert message.startswith("weights: ") and dropped in message and message.count("\n") == 1, message
