"""Grammar-constrained decoding benchmark: what a JSON-schema grammar costs the engine's decode step.

    python -m bench.grammar [--config small|tiny] [--rounds 5] [--new 48] [--threads 1]

In one run, on the CPU in float32, with a random checkpoint (bench/engine.py `random_model`) and a
synthetic byte-level tokenizer.json of the model's vocabulary (`synthetic_tokenizer`), it decodes 8
requests together (`max_batch` 8, tokens read back every step, as the server streams) with 0, 1 and
8 of them constrained by the same JSON-schema grammar (`GRAMMAR`: an array of objects that never
ends within the run, so every step of every row is constrained). The three cases run in interleaved
rounds, so a change in machine load hits them alike, and it prints the median decode-step time of
each (the whole turn: the forward, the sampler, the mask upload, the read point and the host's mask
computation), the mask computation alone (`stats["mask_seconds"]`), and the overhead of 8 constrained
rows against none (the goal is at most 10 %).

Then the mask time alone at Gemma 4's real vocabulary size (262,144 tokens, `--mask-vocab`): the tiny
config with that vocabulary and a synthetic tokenizer of that size, 1 and 8 constrained slots, the
host's mask computation per slot per step in µs (with 8, llguidance's masks run in parallel over
rayon's threads, so the per-slot figure is the wall time divided by 8).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.engine import SMALL_OVERRIDES, random_model

SLOTS = 8
EOS = 1
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 24},
            "ok": {"type": "boolean"},
            "color": {"enum": ["red", "green", "blue", "cyan"]},
        },
        "required": ["id", "name", "ok", "color"],
        "additionalProperties": False,
    },
    "minItems": 1000,
}
GRAMMAR = "start: %json" + json.dumps(SCHEMA)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character map (the one byte-level BPE tokenizer.json files spell tokens in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def synthetic_tokenizer(vocab_size: int, path: Path) -> None:
    """Write a byte-level BPE tokenizer.json of `vocab_size` tokens: <pad> <eos> <bos>, the 256 single
    bytes, then every string of 2, 3, ... characters over JSON-ish characters until the vocabulary is
    full (no merges: only the token bytes matter to the grammar's token environment)."""
    chars = _byte_chars()
    specials = ["<pad>", "<eos>", "<bos>"]
    vocab: dict[str, int] = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab.setdefault(chars[b], len(vocab))
    alphabet = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 {}[]":,.-_'
    for n in itertools.count(2):
        for combo in itertools.product(alphabet, repeat=n):
            if len(vocab) >= vocab_size:
                break
            vocab.setdefault("".join(chars[b] for b in "".join(combo).encode()), len(vocab))
        if len(vocab) >= vocab_size:
            break
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, s in enumerate(specials)]
    level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    path.write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **level}, "post_processor": None,
        "decoder": {"type": "ByteLevel", **level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }))


def make_checkpoint(overrides: dict, root: Path):
    """A random float32-loadable checkpoint with eos id 1 and its synthetic tokenizer in `root`."""
    from tests.checkpoints.text import tiny_text_config

    config = tiny_text_config(eos_token_id=[EOS], **overrides)
    random_model(config, "cpu").save_pretrained(root)
    synthetic_tokenizer(config.vocab_size, root / "tokenizer.json")
    return config


def decode_run(engine, vocab: int, constrained: int, new: int) -> tuple[list[float], list[float]]:
    """One batch of SLOTS greedy requests, the first `constrained` under GRAMMAR, decoded together.
    Returns the seconds and the mask seconds of each decode-only turn with every slot decoding."""
    import gemma_engine

    # eos biased away in every request (constrained or not, so each runs the same sampler stages): every
    # request runs its full length.
    params = gemma_engine.SamplingParams(logit_bias={EOS: -100.0})
    requests = [
        gemma_engine.Request(i, [2] + [(31 * i + 7 * j) % (vocab - 3) + 3 for j in range(15)], new,
                             sampling=params, grammar=GRAMMAR if i < constrained else None)
        for i in range(SLOTS)
    ]
    steps, masks, state = [], [], {"sent": False, "done": 0}

    def poll(free, idle):
        if not state["sent"]:
            state["sent"] = True
            return requests, []
        return None if state["done"] == SLOTS else ([], [])

    def on_events(events, stats):
        for e in events:
            assert e.finish in (None, "length"), (e.finish, e.error)
            state["done"] += e.finish is not None
        if stats.get("batch_sizes") == [SLOTS] and stats["prompt_tokens"] == 0:
            steps.append(stats["seconds"])
            masks.append(stats["mask_seconds"])

    engine.run(poll, on_events, 1)
    return steps[1:], masks[1:]  # the first turn after the prompts warms the step's shape


def interleaved(engine, vocab: int, cases: tuple[int, ...], rounds: int, new: int) -> dict[int, dict[str, float]]:
    """Median step and mask seconds of each case over `rounds` interleaved rounds."""
    got = {c: ([], []) for c in cases}
    decode_run(engine, vocab, max(cases), 8)  # warm-up
    for r in range(rounds):
        for c in cases:
            steps, masks = decode_run(engine, vocab, c, new)
            got[c][0].extend(steps)
            got[c][1].extend(masks)
            print(f"  round {r}: {c} constrained: step {1e3 * statistics.median(steps):.2f} ms, "
                  f"masks {1e3 * statistics.median(masks):.3f} ms", flush=True)
    return {c: {"step": statistics.median(s), "mask": statistics.median(m)} for c, (s, m) in got.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.grammar", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=("small", "tiny"), default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=48, help="generated tokens per request")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--mask-vocab", type=int, default=262_144, help="vocabulary of the mask-time run (0: skip)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import gemma_engine

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "model"
        config = make_checkpoint(SMALL_OVERRIDES if args.config == "small" else {}, root)
        grammars = gemma_engine.Grammars(str(root / "tokenizer.json"), [EOS], config.vocab_size)
        engine = gemma_engine.Engine(str(root), like=torch.zeros(1), context=64 + args.new, dtype="float32",
                                     max_batch=SLOTS, grammars=grammars)
        print(f"config {args.config}: hidden {config.hidden_size}, layers {config.num_hidden_layers}, vocab "
              f"{config.vocab_size}; CPU float32, {SLOTS} slots, {args.new} tokens each, torch threads "
              f"{torch.get_num_threads()}, rounds {args.rounds}", flush=True)
        res = interleaved(engine, config.vocab_size, (0, 1, SLOTS), args.rounds, args.new)
    for c, r in res.items():
        print(f"{c} of {SLOTS} constrained: step {1e3 * r['step']:.2f} ms (masks {1e3 * r['mask']:.3f} ms)")
    print(f"overhead of {SLOTS} constrained against 0: {100 * (res[SLOTS]['step'] / res[0]['step'] - 1):+.1f} % "
          f"(1 constrained: {100 * (res[1]['step'] / res[0]['step'] - 1):+.1f} %; goal <= 10 %)", flush=True)

    if args.mask_vocab:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "model"
            t0 = time.perf_counter()
            config = make_checkpoint({"vocab_size": args.mask_vocab, "vocab_size_per_layer_input": args.mask_vocab}, root)
            grammars = gemma_engine.Grammars(str(root / "tokenizer.json"), [EOS], config.vocab_size)
            print(f"vocab {config.vocab_size}: checkpoint and token environment in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            t0 = time.perf_counter()
            grammars.check(GRAMMAR)
            print(f"vocab {config.vocab_size}: GRAMMAR compiles in {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
            engine = gemma_engine.Engine(str(root), like=torch.zeros(1), context=64 + args.new, dtype="float32",
                                         max_batch=SLOTS, grammars=grammars)
            res = interleaved(engine, config.vocab_size, (0, 1, SLOTS), max(1, args.rounds // 2), args.new)
        for c in (1, SLOTS):
            print(f"vocab {config.vocab_size}, {c} constrained: mask {1e6 * res[c]['mask'] / c:.0f} µs per slot per "
                  f"step (wall {1e3 * res[c]['mask']:.3f} ms a step); step {1e3 * res[c]['step']:.2f} ms against "
                  f"{1e3 * res[0]['step']:.2f} ms unconstrained")


if __name__ == "__main__":
    main()
