"""The tiny checkpoint with both towers, image and audio, laid out as the hub's Gemma 4 checkpoints
(``save_multimodal`` -> fixtures ``multimodal_checkpoint``, ``multimodal_w4a16_checkpoint``,
``multimodal_bidirectional_checkpoint``), its Transformers reference, and deterministic inputs for it
(``random_image``, ``random_audio``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedConfig

from tests.checkpoints.agent import AGENT_CORPUS, AGENT_VOCAB_SIZE, GEMMA4_SPECIAL_TOKENS, agent_text_config
from tests.checkpoints.quantized import decompressed, quantize_in_place, w4a16_config
from tests.checkpoints.shared import byte_level_bpe, one_thread, save_tokenizer
from tests.checkpoints.text import random_model

# Gemma 4's media markers besides GEMMA4_SPECIAL_TOKENS' placeholders: begin and end of an image (<|image>,
# <image|>) and of an audio clip (<|audio>, <audio|>), as Google's tokenizer names them. Ids 18-21.
MULTIMODAL_SPECIAL_TOKENS = GEMMA4_SPECIAL_TOKENS + ("<|image>", "<image|>", "<|audio>", "<audio|>")
MULTIMODAL_SEED = 0
# The image processor's smallest budget (Gemma4ImageProcessor's _SUPPORTED_SOFT_TOKENS): at most 70 soft tokens.
MULTIMODAL_MAX_SOFT_TOKENS = 70


def build_multimodal_tokenizer() -> Tokenizer:
    """The agent tokenizer's recipe with MULTIMODAL_SPECIAL_TOKENS; AGENT_VOCAB_SIZE tokens."""
    return byte_level_bpe(MULTIMODAL_SPECIAL_TOKENS, AGENT_VOCAB_SIZE, AGENT_CORPUS, use_regex=False)


def tiny_multimodal_config(bidirectional: bool = False) -> PreTrainedConfig:
    """A small ``Gemma4Config`` with both towers (Transformers 5.18 ``configuration_gemma4.py``).

    Text: ``agent_text_config`` (E-series features, no bidirectional attention, as E2B/E4B; with
    `bidirectional`, ``use_bidirectional_attention="vision"`` as the larger Gemma 4 models set it: sliding
    layers read an image's soft tokens both ways). Vision: 2 layers,
    hidden 64, 2 heads of 32, 4-pixel patches pooled 2x2, a 64-entry position table, clipped linears and
    standardisation on. Audio: 2 conformer layers, hidden 64, 2 heads, subsampling channels (128, 8) over the
    feature extractor's 128 mel bins, chunks of 12 with 12 frames of left context, output 96. Media ids are
    the tokenizer's (``build_multimodal_tokenizer``).
    """
    from transformers import Gemma4Config

    tok = build_multimodal_tokenizer()
    ids = {t: tok.token_to_id(t) for t in MULTIMODAL_SPECIAL_TOKENS}
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=32, patch_size=4, pooling_kernel_size=2, position_embedding_size=64,
                  use_clipped_linears=True, standardize=True, rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
    audio = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[128, 8],
                 conv_kernel_size=5, attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
                 output_proj_dims=96, use_clipped_linears=True)
    text = agent_text_config(use_bidirectional_attention="vision" if bidirectional else None)
    return Gemma4Config(
        text_config=text.to_dict(), vision_config=vision, audio_config=audio,
        image_token_id=ids["<|image|>"], audio_token_id=ids["<|audio|>"], video_token_id=ids["<|video|>"],
        boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"], boa_token_id=ids["<|audio>"],
        eoa_token_index=ids["<audio|>"],
    )


def _init_media_tensor(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """One tower tensor: norms and scales around 1, tables and linears unit-variance, clip bounds that bite."""
    if name.endswith(("input_min", "output_min")):
        return -torch.empty(shape).uniform_(1.5, 3.0, generator=gen)
    if name.endswith(("input_max", "output_max")):
        return torch.empty(shape).uniform_(1.5, 3.0, generator=gen)
    if name.endswith(("norm.weight", "norm_out.weight", "norm_pre_attn.weight", "norm_post_attn.weight", "std_scale")):
        return torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
    if name.endswith(("std_bias", "per_dim_scale", "output_proj.bias")):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith("position_embedding_table"):
        return torch.randn(shape, generator=gen) * 0.5
    if len(shape) >= 2:
        # Linear [out, in] and convolutions [out, in / groups, *kernel]: unit-variance outputs.
        return torch.randn(shape, generator=gen) / math.sqrt(shape[1:].numel())
    raise ValueError(f"no init rule for tensor {name} of shape {tuple(shape)}")


def random_multimodal_model(seed: int = MULTIMODAL_SEED, bidirectional: bool = False):
    """A deterministic random float32 ``Gemma4ForConditionalGeneration`` (``tiny_multimodal_config``) with
    bf16-representable weights: the text model's as ``random_model`` draws them, then the towers' parameters and
    their persistent buffers (clip bounds, standardisation) in sorted-name order from one generator."""
    from transformers import Gemma4ForConditionalGeneration

    config = tiny_multimodal_config(bidirectional)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma4ForConditionalGeneration(config)
    text = random_model(config.text_config, seed)
    state = model.state_dict()
    persistent = {n for n, _ in model.named_parameters()} | {
        n for n, b in model.named_buffers() if n.endswith(("_min", "_max", "std_bias", "std_scale", "layer_scalar"))
    }
    gen = torch.Generator().manual_seed(seed)
    text_state = text.state_dict()
    with torch.no_grad():
        for name in sorted(persistent):
            t = state[name]
            if name.startswith("model.language_model."):
                value = text_state["model." + name.removeprefix("model.language_model.")]
            elif name == "lm_head.weight":
                continue
            else:
                value = _init_media_tensor(name, t.shape, gen)
            t.copy_(value.to(torch.bfloat16).to(t.dtype))
    model.eval()
    return model


def save_multimodal(out_dir: str | Path, template: str, seed: int = MULTIMODAL_SEED,
                    bidirectional: bool = False, w4a16_group: int | None = None) -> Path:
    """Write a checkpoint with both towers as the hub lays Gemma 4 out: ``Gemma4ForConditionalGeneration``
    weights in bf16 (``model.language_model.*``, ``model.vision_tower.*``, ``model.audio_tower.*``,
    ``model.embed_vision.*``, ``model.embed_audio.*``), the tokenizer with MULTIMODAL_SPECIAL_TOKENS (its
    ``extra_special_tokens`` name the media markers, as Gemma4Processor reads them), `template` as the chat
    template, and Transformers' own processor configuration (``Gemma4Processor`` with the Pillow image
    processor at 4-pixel patches, 2x2 pooling and at most MULTIMODAL_MAX_SOFT_TOKENS soft tokens, and the
    default ``Gemma4AudioFeatureExtractor``; the video processor the class requires, at the same patches), saved
    by ``save_pretrained``. `bidirectional`: see ``tiny_multimodal_config``. With `w4a16_group`, every
    ``Linear`` of the text model and both towers (their clippable linears' inner ``linear``, the embedders'
    projections, the audio tower's relative-position and output projections) is int4 pack-quantized with
    that group size, as ``save_w4a16`` quantizes the text model.
    """
    from transformers.models.gemma4 import Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    out_dir = Path(out_dir)
    with one_thread():
        model = random_multimodal_model(seed, bidirectional).to(torch.bfloat16)
        compressor = None if w4a16_group is None else quantize_in_place(model, w4a16_config(w4a16_group))
        model.save_pretrained(out_dir)
    if compressor is not None:
        compressor.update_config(str(out_dir))
    extra = [t for t in MULTIMODAL_SPECIAL_TOKENS if t not in ("<pad>", "<bos>", "<turn|>")]
    save_tokenizer(out_dir, build_multimodal_tokenizer(), AGENT_VOCAB_SIZE, "<turn|>", extra, template)
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["extra_special_tokens"] = {
        "image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
        "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
    }
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    image_processor = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2,
                                              max_soft_tokens=MULTIMODAL_MAX_SOFT_TOKENS)
    processor = Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=image_processor,
                                tokenizer=tokenizer, chat_template=template,
                                video_processor=Gemma4VideoProcessor(patch_size=4, pooling_kernel_size=2,
                                                                     max_soft_tokens=MULTIMODAL_MAX_SOFT_TOKENS),
                                image_seq_length=MULTIMODAL_MAX_SOFT_TOKENS)
    processor.save_pretrained(out_dir)
    return out_dir


def load_multimodal_reference(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """``Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype)`` in eval mode: the plain call
    (a W4A16 checkpoint decompressed at once, as ``load_hf_reference`` does)."""
    from transformers import Gemma4ForConditionalGeneration

    return decompressed(Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype)).eval()


def random_image(width: int, height: int, seed: int = 0):
    """A deterministic RGB ``PIL.Image`` of smooth colour gradients plus noise (``seed``)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    base = torch.stack([x, y, (x + y) / 2], dim=-1)
    pixels = (base * 0.7 + torch.rand(height, width, 3, generator=gen) * 0.3).clamp(0, 1)
    return Image.fromarray((pixels * 255).round().to(torch.uint8).numpy(), mode="RGB")


def random_audio(seconds: float, seed: int = 0, rate: int = 16_000):
    """A deterministic mono float32 waveform (numpy) at `rate`: two chirps plus a little noise."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * rate), dtype=torch.float64) / rate
    wave = 0.4 * torch.sin(2 * math.pi * (220 + 400 * t) * t) + 0.2 * torch.sin(2 * math.pi * 1250 * t)
    wave = wave + 0.02 * torch.randn(wave.shape, generator=gen, dtype=torch.float64)
    return wave.to(torch.float32).numpy()
