"""Train a small MTP assistant drafter to imitate a target (distillation on the CPU), for bench/speculative.py.

Random weights never agree with each other, so a random assistant's drafts are never kept. This trains one on
the target's own greedy text, the way the assistant drafts in the engine (Transformers 5.18
`generation/candidate_generator.py`, `SinglePositionMultiTokenCandidateGenerator`): at position `p` of a text
the assistant reads the target's embedding of token `p` and the target's final hidden state at `p - 1`, attends
to the target's keys before `p` (of a sliding layer, the last `sliding_window`), and its `j`-th draft, fed its
own projected state back, should be the target's token `p + j`. Every position of every text is a training
example at once (one forward, a mask per query), every draft depth in turn; the tokens fed back are the target's
(teacher forcing). Adam, cross-entropy against the target's tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masks(length: int, window: int) -> dict[str, torch.Tensor]:
    """bool `[1, 1, length, length]` per layer type: query `p` sees keys `< p`, and on sliding layers only the
    last `window` of them (what the engine's drafter reads, rust/src/gemma4/assistant.rs)."""
    q = torch.arange(length).view(length, 1)
    k = torch.arange(length).view(1, length)
    full = k < q
    return {"full_attention": full[None, None], "sliding_attention": (full & (k >= q - window))[None, None]}


@torch.no_grad()
def target_texts(target, prompts: list[list[int]], new: int) -> torch.Tensor:
    """The target's greedy continuations of `prompts` (all of one length), `[n, prompt + new]`."""
    ids = torch.tensor(prompts)
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)


def draft_logits(assistant, target, texts: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """The assistant's logits for drafts 1..`depth` at every position `p` in `1..L - depth` of `texts`
    (`[n, L]`), teacher-forced: `[n, L - depth - 1, vocab]` per depth."""
    n, length = texts.shape
    with torch.no_grad():
        out = target(texts, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
        embeds = target.get_input_embeddings()(texts)
    kv = out.shared_kv_states
    hidden = out.hidden_states[-1]
    last = length - depth  # queries at positions 1 .. last - 1
    pos = torch.arange(1, last).expand(n, -1)
    mask = {kind: m[:, :, 1:last] for kind, m in masks(length, target.config.sliding_window).items()}
    state = hidden[:, : last - 1]
    logits = []
    for j in range(depth):
        x = assistant.pre_projection(torch.cat([embeds[:, 1 + j: last + j], state], dim=-1))
        y = assistant.model(inputs_embeds=x, attention_mask=mask, position_ids=pos, shared_kv_states=kv,
                            use_cache=False).last_hidden_state
        logits.append(assistant.lm_head(y))
        state = assistant.post_projection(y)
    return logits


def distill(assistant, target, texts: torch.Tensor, steps: int, depth: int, batch: int = 8,
            lr: float = 2e-3, log=print) -> float:
    """Train `assistant` for `steps` steps of `batch` texts on `texts`; returns the last step's share of drafts
    whose argmax is the target's token, over every depth."""
    opt = torch.optim.Adam(assistant.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    assistant.train()
    hit = 0.0
    for step in range(steps):
        pick = texts[torch.randint(0, len(texts), (batch,), generator=gen)]
        logits = draft_logits(assistant, target, pick, depth)
        length = pick.shape[1]
        labels = [pick[:, 2 + j: length - depth + 1 + j] for j in range(depth)]
        loss = sum(F.cross_entropy(lg.flatten(0, 1), lb.flatten()) for lg, lb in zip(logits, labels)) / depth
        opt.zero_grad()
        loss.backward()
        opt.step()
        hit = float(sum((lg.argmax(-1) == lb).float().mean() for lg, lb in zip(logits, labels)) / depth)
        if step % 50 == 0 or step == steps - 1:
            log(f"  distill step {step:4d}: loss {loss.item():.3f}, drafts right {hit:.2f}")
    assistant.eval()
    return hit
