"""Media prompt benchmark: reading an image prompt and an audio prompt, the Rust engine (`gemma_engine.Encoder`
and `Engine`) against Transformers' `Gemma4ForConditionalGeneration`, on the same random checkpoint and device,
in one run.

    python -m bench.media [--device cpu|cuda] [--dtype float32|bfloat16] [--repeats 5] [--kinds image,audio]

The checkpoint is bench/engine.py's small text config (hidden 512, 8 layers) with a vision tower and an
audio tower at a CPU-bench size (vision: hidden 384, 8 layers, 16-pixel patches pooled 3x3, 70 soft
tokens from 630 patches; audio: hidden 384, 6 conformer layers, 10 s of audio, 250 soft tokens), random
weights, written once in bfloat16. Both sides get the inputs of Transformers' own Gemma4Processor for one
chat turn holding the image (or the clip) and a line of text.

For each prompt it prints the median over `--repeats` runs of

* tower: the encoder alone (pixels or features to soft tokens in the text model's width): the engine's
  `Encoder.image` / `Encoder.audio` against `get_image_features` / `get_audio_features`;
* read: the whole prompt read to the first token: the encoder plus the engine's prompt read (a request
  with `max_new=1`, prefix caching off) against Transformers' `generate(max_new_tokens=1)`;

and the Rust/Transformers ratios (below 1: the engine is faster). The weights are random; the first tokens
of both sides are printed for information (parity is tests/engine/test_media.py and test_audio_tower.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.engine import make_config, sync

VISION = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=6,
              num_key_value_heads=6, head_dim=64, patch_size=16, pooling_kernel_size=3,
              position_embedding_size=1024, use_clipped_linears=False, standardize=True,
              rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
AUDIO = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, subsampling_conv_channels=[128, 32],
             conv_kernel_size=5, attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
             output_proj_dims=768, use_clipped_linears=True)
MAX_SOFT_TOKENS = 70
AUDIO_SECONDS = 10.0
# Media token ids inside the small config's 8k vocabulary.
IDS = dict(image_token_id=8000, audio_token_id=8001, video_token_id=8002, boi_token_id=8003, eoi_token_id=8004,
           boa_token_id=8005, eoa_token_index=8006)


def write_checkpoint(out: Path) -> Path:
    """The random bf16 checkpoint with both towers (module docs)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = make_config("small")
    config = Gemma4Config(text_config=text.to_dict(), vision_config=VISION, audio_config=AUDIO, **IDS)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("std_scale"):
                b.fill_(1.0)
            elif name.endswith(("std_bias", "layer_scalar")):
                b.fill_(0.0 if name.endswith("std_bias") else 1.0)
            elif name.endswith(("input_min", "output_min")):
                b.fill_(-10.0)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(10.0)
    model.save_pretrained(out)
    return out


def inputs(kind: str):
    """Gemma4Processor-equivalent tensors for one image or one clip: (pieces for the towers, prompt ids,
    media placeholder runs). Built with Transformers' image processor and feature extractor; the prompt is
    bos, the boi/boa marker, the placeholders, the eoi/eoa marker and eight text ids."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from tests.checkpoints.multimodal import random_audio, random_image

    text = list(range(100, 108))
    if kind == "image":
        processor = Gemma4ImageProcessorPil(patch_size=16, pooling_kernel_size=3, max_soft_tokens=MAX_SOFT_TOKENS)
        pieces = processor([random_image(640, 480, 0)], return_tensors="pt")
        n = int(pieces["num_soft_tokens_per_image"][0])
        ids = [2, IDS["boi_token_id"]] + [IDS["image_token_id"]] * n + [IDS["eoi_token_id"]] + text
        return dict(pixel_values=pieces["pixel_values"], image_position_ids=pieces["image_position_ids"]), ids, 2
    features = Gemma4AudioFeatureExtractor()([random_audio(AUDIO_SECONDS)], return_tensors="pt", sampling_rate=16_000)
    return dict(input_features=features["input_features"], input_features_mask=features["input_features_mask"]), None, 2


def median_time(fn, repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    import gemma_engine
    from transformers import Gemma4ForConditionalGeneration

    parser = argparse.ArgumentParser(prog="python -m bench.media", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kinds", default="image,audio", help="comma-separated: image, audio")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "ckpt")
        like = torch.zeros(1, device=args.device)
        encoder = gemma_engine.Encoder(str(model_dir), like=like, dtype=args.dtype)
        engine = gemma_engine.Engine(str(model_dir), like=like, dtype=args.dtype, context=1024, prefill_chunk=512,
                                     prefix_caching=False)
        reference = Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
        print(f"device {args.device}, dtype {args.dtype}, threads {torch.get_num_threads()}, "
              f"median of {args.repeats}")
        for kind in args.kinds.split(","):
            run_one(kind, encoder, engine, reference, args, dtype)


def run_one(kind, encoder, engine, reference, args, dtype) -> None:
    import gemma_engine

    pieces, ids, start = inputs(kind)
    pieces = {k: v.to(args.device) for k, v in pieces.items()}

    def ours_tower():
        if kind == "image":
            return encoder.image(pieces["pixel_values"], pieces["image_position_ids"])
        return encoder.audio(pieces["input_features"].to(dtype), pieces["input_features_mask"])

    soft = ours_tower()[0]
    n = soft.shape[0]
    if ids is None:
        ids = [2, IDS["boa_token_id"]] + [IDS["audio_token_id"]] * n + [IDS["eoa_token_index"]] + list(range(100, 108))
    hf_inputs = dict(pieces, input_ids=torch.tensor([ids], device=args.device))
    if kind == "audio":
        hf_inputs["input_features"] = hf_inputs["input_features"].to(dtype)
    else:
        hf_inputs["pixel_values"] = hf_inputs["pixel_values"].to(dtype)

    @torch.no_grad()
    def hf_tower():
        if kind == "image":
            return reference.model.get_image_features(hf_inputs["pixel_values"], pieces["image_position_ids"])
        return reference.model.get_audio_features(hf_inputs["input_features"], pieces["input_features_mask"])

    def ours_read():
        media = [(start, ours_tower()[0], 1)]
        done = {}

        def poll(free, idle):
            if done.get("sent"):
                return None if done.get("finished") else ([], [])
            done["sent"] = True
            return [gemma_engine.Request(1, ids, 1, media=media)], []

        def on_events(events, _stats):
            for e in events:
                done.setdefault("tokens", []).extend(e.tokens)
                if e.finish:
                    done["finished"] = True

        engine.run(poll, on_events)
        return done.get("tokens", [])

    @torch.no_grad()
    def hf_read():
        out = reference.generate(**hf_inputs, max_new_tokens=1, do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    ours_read(), hf_read(), hf_tower()  # warm-up
    rows = [("tower", median_time(ours_tower, args.repeats, args.device), median_time(hf_tower, args.repeats, args.device)),
            ("read", median_time(ours_read, args.repeats, args.device), median_time(hf_read, args.repeats, args.device))]
    print(f"\n{kind}: {len(ids)} prompt tokens, {n} soft tokens")
    print(f"  {'':6} {'rust s':>9} {'transformers s':>15} {'ratio':>7}")
    for name, ours, theirs in rows:
        print(f"  {name:6} {ours:9.4f} {theirs:15.4f} {ours / theirs:7.2f}")
    print(f"  first token: rust {ours_read()}, transformers {hf_read()}")


if __name__ == "__main__":
    main()
