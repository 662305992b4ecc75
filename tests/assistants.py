"""Small Gemma 4 MTP assistant drafters (Transformers 5.18 `Gemma4AssistantForCausalLM`) for the tiny targets of
tests/checkpoints/text.py, and the reference's drafting step.

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

from tests.checkpoints.shared import FULL, SLIDING, one_thread
from tests.checkpoints.text import tiny_text_config

SEED = 7


def assistant_config(target: Gemma4TextConfig | None = None, hidden: int = 64, ordered: bool = False,
                     centroids: int = 16, top_k: int = 4) -> Gemma4AssistantConfig:
    """Two layers (S F) of hidden size `hidden` for `target` (``tiny_text_config()`` when None), reading its keys:
    its sliding layers' `head_dim` and KV heads, its full layers' own (`per_layer_config`: `global_head_dim`, and
    with K=V `num_global_key_value_heads`), one query head a sliding KV head;
    with `ordered`, the masked embedder (`centroids` centroids, the best `top_k` read)."""
    target = (target or tiny_text_config()).to_dict()  # plain values: a per-layer config's globals are ambiguous
    # The full layers' geometry (head_dim, and with K=V num_key_value_heads), as the target's config writes it.
    full = next((dict(v) for k, v in (target.get("per_layer_config") or {}).items()
                 if target["layer_types"][int(k)] == FULL), {"head_dim": target["head_dim"]})
    text = Gemma4TextConfig(
        vocab_size=target["vocab_size"], hidden_size=hidden, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=target["num_key_value_heads"], num_key_value_heads=target["num_key_value_heads"],
        head_dim=target["head_dim"], per_layer_config={"1": full},
        sliding_window=target["sliding_window"], layer_types=[SLIDING, FULL], num_kv_shared_layers=2,
        rope_parameters=target["rope_parameters"], final_logit_softcapping=30.0, rms_norm_eps=1e-6,
        max_position_embeddings=target["max_position_embeddings"],
        tie_word_embeddings=True, enable_moe_block=False, use_double_wide_mlp=False,
        hidden_activation="gelu_pytorch_tanh")
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target["hidden_size"],
                                 use_ordered_embeddings=ordered, num_centroids=centroids,
                                 centroid_intermediate_top_k=top_k)


def random_assistant(config: Gemma4AssistantConfig, seed: int = SEED) -> Gemma4AssistantForCausalLM:
    """Transformers' own init, seeded; with ordered embeddings a random token ordering (the init leaves it zero)."""
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(config).eval()
    if config.use_ordered_embeddings:
        model.masked_embedding.token_ordering.copy_(torch.randperm(model.vocab_size))
    return model


def save_assistant(out_dir: str | Path, ordered: bool = False, seed: int = SEED,
                   target: Gemma4TextConfig | None = None) -> Path:
    """A random assistant (`random_assistant`) for `target`, saved in float32."""
    out_dir = Path(out_dir)
    with one_thread():
        random_assistant(assistant_config(target, ordered=ordered), seed).save_pretrained(out_dir)
    return out_dir


def save_two_token_assistant(source: str | Path, two_token_target: str | Path, out_dir: str | Path) -> Path:
    """A copy of the assistant `source` that drafts the two-token target's tokens (checkpoints.save_two_token):
    its final norm's weight is zero but for feature 0, and its tied table's column 0 is the target's, so each draft
    is one of that column's two extreme tokens, the one the sign of its own feature 0 picks. Its drafts are often
    kept and often not: every path of a verify step runs."""
    out_dir = Path(out_dir)
    shutil.copytree(source, out_dir)
    target = {k: v for f in Path(two_token_target).glob("*.safetensors") for k, v in load_file(f).items()}
    table = next(v for k, v in target.items() if k.endswith(".embed_tokens.weight"))
    path = out_dir / "model.safetensors"
    tensors = load_file(path)
    weight = torch.zeros_like(tensors["model.norm.weight"])
    weight[0] = 1.0
    tensors["model.norm.weight"] = weight
    tensors["model.embed_tokens.weight"][:, 0] = table[:, 0].float()
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
