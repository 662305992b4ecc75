"""Small Gemma 4 MTP assistant drafters (Transformers 5.18 `Gemma4AssistantForCausalLM`) for the tiny targets of
tests/checkpoints.py, and the reference's drafting step.

An assistant reads the target's keys of its last own-KV layer of each type (`shared_kv_states`), so its layers'
head geometry is the target's there: sliding layers `head_dim` 32 with 2 KV heads, full ones `global_head_dim`
64 (``tiny_text_config``).
"""

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM
from transformers.models.gemma4 import Gemma4TextConfig

from tests.checkpoints import FULL, SLIDING, one_thread, tiny_text_config

SEED = 7


def tiny_assistant_config(ordered: bool = False, vocab_size: int | None = None) -> Gemma4AssistantConfig:
    """Two layers (S F) of hidden size 64 over a ``tiny_text_config`` target (of `vocab_size` tokens, the tiny
    config's by default); with `ordered`, the masked embedder (16 centroids, the best 4 read)."""
    target = tiny_text_config()
    text = Gemma4TextConfig(
        vocab_size=vocab_size or target.vocab_size, hidden_size=64, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        global_head_dim=64, sliding_window=target.sliding_window, layer_types=[SLIDING, FULL],
        num_kv_shared_layers=2, rope_parameters=target.rope_parameters, final_logit_softcapping=30.0,
        rms_norm_eps=1e-6, max_position_embeddings=1024, tie_word_embeddings=True, enable_moe_block=False,
        use_double_wide_mlp=False, attention_k_eq_v=False, hidden_activation="gelu_pytorch_tanh")
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target.hidden_size,
                                 use_ordered_embeddings=ordered, num_centroids=16, centroid_intermediate_top_k=4)


def save_assistant(out_dir: str | Path, ordered: bool = False, seed: int = SEED, vocab_size: int | None = None) -> Path:
    """A randomly initialized assistant (Transformers' own init, seeded); with `ordered` its token ordering is
    a random permutation (the init leaves it zero). Saved in float32."""
    out_dir = Path(out_dir)
    with one_thread():
        torch.manual_seed(seed)
        model = Gemma4AssistantForCausalLM(tiny_assistant_config(ordered, vocab_size)).eval()
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(model.vocab_size))
        model.save_pretrained(out_dir)
    return out_dir


def save_two_token_assistant(source: str | Path, two_token_target: str | Path, out_dir: str | Path) -> Path:
    """A copy of the assistant `source` that drafts the two-token target's tokens (checkpoints.save_two_token):
    its final norm's weight is zero but for feature 0, and its tied table's column 0 is the target's, so each draft
    is one of that column's two extreme tokens, the one the sign of its own feature 0 picks. Its drafts are often
    kept and often not: every path of a verify step runs."""
    out_dir = Path(out_dir)
    shutil.copytree(source, out_dir)
    target = {k: v for f in Path(two_token_target).glob("*.safetensors") for k, v in load_file(f).items()}
    path = out_dir / "model.safetensors"
    tensors = load_file(path)
    weight = torch.zeros_like(tensors["model.norm.weight"])
    weight[0] = 1.0
    tensors["model.norm.weight"] = weight
    tensors["model.embed_tokens.weight"][:, 0] = target["model.embed_tokens.weight"][:, 0].float()
    save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


def load_assistant(model_dir: str | Path) -> Gemma4AssistantForCausalLM:
    return Gemma4AssistantForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def reference_drafts(target: Gemma4ForCausalLM, assistant: Gemma4AssistantForCausalLM, seq: list[int],
                     k: int) -> list[int]:
    """`k` drafts after `seq`, whose last token is the next input (at position `len(seq) - 1`), by Transformers'
    drafting loop (`SinglePositionMultiTokenCandidateGenerator.get_candidates`): the target's final hidden
    state before that token and its keys up to there; of a sliding layer's keys the last `sliding_window`, which
    is what the target's ring holds."""
    p = len(seq) - 1
    out = target(torch.tensor([seq[:p]]), output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
    window = target.config.sliding_window
    shared = {kind: (k_[:, :, -window:], v_[:, :, -window:]) if kind == SLIDING else (k_, v_)
              for kind, (k_, v_) in out.shared_kv_states.items()}
    hidden, token, drafts = out.hidden_states[-1][:, -1:], torch.tensor([[seq[-1]]]), []
    for _ in range(k):
        embeds = torch.cat([target.get_input_embeddings()(token), hidden], dim=-1)
        step = assistant(inputs_embeds=embeds, position_ids=torch.tensor([[p]]), shared_kv_states=shared)
        token, hidden = step.logits.argmax(dim=-1), step.last_hidden_state
        drafts.append(int(token))
    return drafts
