"""Fakes for the few tests that need a timing the real engine cannot give on demand.

`FakeGatedEngine` decodes only while its gate is open, so a test can hold a request "running" for as
long as it needs (queue overflow -> 429) and then let it finish. It has the real engine's Python surface
(gemma_engine.pyi) and answers the real tokenizer's ids. Everything else in those tests is real: the
server, the tokenizer, the sockets, the openai SDK.
"""

from __future__ import annotations

import threading

from gemma_server.boot import Boot, Loaded


class FakeGatedEngine:
    """Emits `token` once per step while `gate` is set; blocks while it is clear.

    Args:
        tokenizer: the real tokenizer (for vocab_size and eos).
        token: the id every step produces.
    """

    def __init__(self, tokenizer, token: int, context: int = 256) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.decoding = threading.Event()  # set while a decode runs
        self.token = token
        self.context = context
        self.vocab_size = len(tokenizer)
        self.eos_ids = [tokenizer.eos_token_id]
        self.dtype = "float32"
        self.device = "cpu"
        self.decodes = 0

    def layout(self) -> dict[str, int]:
        return {"context": self.context}

    def decode(self, ids, max_new, stop_ids=(), read_every=1, on_tokens=None):
        if not ids or max_new < 1:
            raise ValueError("empty prompt or max_new < 1")
        self.decodes += 1
        self.decoding.set()
        out: list[int] = []
        try:
            while len(out) < max_new:
                self.gate.wait()
                out.append(self.token)
                if on_tokens is not None and not on_tokens([self.token]):
                    return out, "cancelled", 0.0, 0.0
            return out, "length", 0.0, 0.0
        finally:
            self.decoding.clear()


def fake_gated_boot(model_dir: str, token_text: str = " fox"):
    """A Boot subclass whose weights stage loads the real tokenizer from `model_dir` and a FakeGatedEngine."""

    class FakeGatedBoot(Boot):
        def _build(self) -> str:
            return "fake engine: nothing to build"

        def _import(self) -> str:
            return "fake engine"

        def _smoke(self) -> str:
            return "fake engine"

        def _weights(self) -> str:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir)
            token = tok.encode(token_text, add_special_tokens=False)[0]
            engine = FakeGatedEngine(tok, token, self.config.context)
            self.loaded = Loaded(engine, tok, engine.context, engine.vocab_size)
            return "fake engine"

        def _warmup(self) -> str:
            return "fake engine"

    return FakeGatedBoot
