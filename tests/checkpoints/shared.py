"""What the checkpoint kinds share: one torch thread while building, the layer type names, and the
byte-level BPE tokenizer recipe and writer of the chat, agent and multimodal checkpoints.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SLIDING = "sliding_attention"
FULL = "full_attention"


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread, then restore the previous count.

    The tiny model gains nothing from more, and on a loaded machine (CI, parallel jobs) OpenMP
    barriers between descheduled threads made a 1 s greedy run take 60 s. Results do not depend on
    it: the builders' ops are elementwise or seeded, and the margins dwarf reduction-order noise.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def byte_level_bpe(special: tuple[str, ...], vocab_size: int, corpus: str, use_regex: bool = True) -> Tokenizer:
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on `corpus`'s lines: ids 0.. are `special`
    (as special tokens), the 256 byte tokens follow, encoding prepends <bos> (id 2). `use_regex` False
    drops ByteLevel's pre-split, so merges may cross words and punctuation.

    Raises:
        RuntimeError: a special token did not get its index as id.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)]
    )
    for i, token in enumerate(special):
        if tokenizer.token_to_id(token) != i:
            raise RuntimeError(f"special token {token} got id {tokenizer.token_to_id(token)}, expected {i}")
    return tokenizer


def save_tokenizer(out_dir: Path, tokenizer: Tokenizer, vocab_size: int, eos: str, extra: list[str],
                    template: str) -> Path:
    """Write `tokenizer` as tokenizer.json and a tokenizer_config.json (<bos>, <pad>, `eos`, the `extra`
    special tokens, the chat `template`) into `out_dir`, so ``AutoTokenizer.from_pretrained`` loads it.

    Raises:
        RuntimeError: the tokenizer does not have `vocab_size` tokens.
    """
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, expected {vocab_size}")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": eos,
        "pad_token": "<pad>",
        "additional_special_tokens": extra,
        "model_max_length": 1024,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return out_dir
