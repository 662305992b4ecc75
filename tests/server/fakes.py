"""Fakes for the few tests that need a timing the real engine cannot give on demand.

`FakeGatedEngine` decodes only while its gate is open, so a test can hold a request "running" for as
long as it needs (queue overflow -> 429) and then let it finish. It speaks the real engine's loop protocol
(`Engine.run(poll, on_events, read_every)` in gemma_engine.pyi) with one sequence slot and answers the real
tokenizer's ids. Everything else in those tests is real: the server, the scheduler, the tokenizer, the
sockets, the openai SDK.

`FakeSlowGrammars` wraps the real grammars with a slow check, so a request stays in its constraint's compile
(admitted, not yet queued) for as long as a test needs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from gemma_server.boot import Boot, Loaded
from gemma_server.scheduler import EngineWorker


@dataclass
class FakeEvent:
    """Has gemma_engine.Event's fields."""

    id: int
    tokens: list[int]
    finish: str | None = None
    error: str | None = None
    logprobs: list = field(default_factory=list)
    prompt_s: float = 0.0
    decode_s: float = 0.0
    cached_tokens: int = 0


class FakeGatedEngine:
    """One slot; emits `token` once per step while `gate` is set, and blocks while it is clear.

    Args:
        tokenizer: the real tokenizer (for vocab_size and eos).
        token: the id every step produces.
    """

    max_batch = 1
    speculative = None

    def __init__(self, tokenizer, token: int, context: int = 256) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.decoding = threading.Event()  # set while a request holds the slot
        self.token = token
        self.context = context
        self.vocab_size = len(tokenizer)
        self.eos_ids = [tokenizer.eos_token_id]
        self.dtype = "float32"
        self.device = "cpu"
        self.decodes = 0

    def layout(self) -> dict[str, int]:
        return {"context": self.context, "max_batch": 1, "kv_bytes_per_slot": 0, "kv_bytes": 0}

    def weights(self):
        return {"int4": "none", "bytes": 0}

    def decode(self, ids, max_new, stop_ids=(), read_every=1, on_tokens=None, sampling=None):
        return [self.token] * max_new, "length", 0.0, 0.0

    def run(self, poll, on_events, read_every=1):
        current = None  # [request, produced]
        while True:
            taken = poll(0 if current else 1, current is None)
            if taken is None:
                if current:
                    on_events([FakeEvent(current[0].id, [], "cancelled")], {})
                return
            requests, cancels = taken
            if current and current[0].id in cancels:
                on_events([FakeEvent(current[0].id, [], "cancelled")], {})
                current = None
                self.decoding.clear()
            if requests:
                current = [requests[0], 0]
                self.decodes += 1
                self.decoding.set()
            if current is None:
                continue
            self.gate.wait()
            current[1] += 1
            done = current[1] >= current[0].max_new
            on_events([FakeEvent(current[0].id, [self.token], "length" if done else None)], {"batch_sizes": [1]})
            if done:
                current = None
                self.decoding.clear()


def fake_gated_boot(model_dir: str, token_text: str = " fox"):
    """A Boot subclass whose weights stage loads the real tokenizer from `model_dir` and a FakeGatedEngine."""

    class FakeGatedBoot(Boot):
        def _build(self) -> str:
            return "fake engine: nothing to build"

        def _import(self) -> str:
            self.devices = ["cpu"]
            return "fake engine"

        def _smoke(self) -> str:
            return "fake engine"

        def _weights(self) -> str:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir)
            token = tok.encode(token_text, add_special_tokens=False)[0]
            worker = EngineWorker(0, "cpu", self.scheduler)
            engine = FakeGatedEngine(tok, token, self.config.context)
            worker.call(lambda: worker.set_engine(engine)).result()
            self.loaded = Loaded(tok, [worker], engine.context, engine.vocab_size)
            return "fake engine"

        def _warmup(self) -> str:
            return "fake engine"

    return FakeGatedBoot


class FakeSlowGrammars:
    """The real `gemma_engine.Grammars` whose check takes `seconds` longer, releasing the GIL as the real one
    does (`py.detach`), and sets `started` when it begins: no real constraint compiles slowly on demand
    (llguidance bounds its work: a schema bomb is refused in milliseconds)."""

    def __init__(self, real, seconds: float):
        self.real, self.seconds, self.started = real, seconds, threading.Event()

    def check(self, grammar: str) -> None:
        self.started.set()
        time.sleep(self.seconds)
        self.real.check(grammar)

    def __getattr__(self, name):
        return getattr(self.real, name)
