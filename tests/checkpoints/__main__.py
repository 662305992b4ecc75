"""``python -m tests.checkpoints --kind chat --out DIR``: write one tiny checkpoint and print its path."""

from __future__ import annotations

import os
from pathlib import Path

from transformers.utils import logging as transformers_logging

from tests.checkpoints.agent import save_agent_chat, save_gemma4_chat
from tests.checkpoints.chat import save_chat
from tests.checkpoints.quantized import GROUP_SIZE, save_w4a16, save_w4a16_emb4
from tests.checkpoints.text import save_dense


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.checkpoints --kind chat --out DIR``: write one checkpoint and print its path."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.checkpoints", description=main.__doc__)
    parser.add_argument("--kind", choices=("dense", "w4a16", "emb4", "chat", "agent", "gemma4"), required=True)
    parser.add_argument("--out", required=True, type=Path, help="checkpoint directory (created)")
    parser.add_argument("--emb-out", type=Path, help="int4 table directory, for --kind emb4")
    parser.add_argument("--group-size", type=int, default=GROUP_SIZE, help="int4 group size (w4a16, emb4)")
    args = parser.parse_args(argv)
    # Quiet the library progress bars (compressed-tensors' tqdm, Transformers' shard writer).
    os.environ.setdefault("TQDM_DISABLE", "1")
    transformers_logging.disable_progress_bar()
    if args.kind == "emb4" and args.emb_out is None:
        parser.error("--kind emb4 needs --emb-out DIR for the int4 tables")
    if args.kind == "dense":
        print(save_dense(args.out))
    elif args.kind == "w4a16":
        print(save_w4a16(args.out, args.group_size))
    elif args.kind == "emb4":
        print(*save_w4a16_emb4(args.out, args.emb_out, args.group_size))
    elif args.kind == "chat":
        print(save_chat(args.out))
    elif args.kind == "agent":
        print(save_agent_chat(args.out))
    else:
        from tests.fetch_chat_templates import INTERLEAVED, template_path

        print(save_gemma4_chat(args.out, template_path(INTERLEAVED).read_text()))


if __name__ == "__main__":
    main()
