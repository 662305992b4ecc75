"""The audio tower (rust/src/gemma4/audio.rs, through `gemma_engine.Encoder.audio`) against Transformers on
the tiny checkpoint with both towers (tests/checkpoints/multimodal.py `save_multimodal`), in float32 and bfloat16.

The features are what Transformers' own `Gemma4AudioFeatureExtractor` (the checkpoint's processor) makes of
two clips of different lengths, padded into one batch with their mask. The reference is the plain
`Gemma4ForConditionalGeneration.from_pretrained(dir, dtype=torch.float32)`: `get_audio_features`' soft tokens
(after the embedder) where the tower's output mask is true, per clip, as Gemma4Model places them.
"""

import pytest
import torch
from transformers import AutoProcessor

import gemma_engine
from tests.checkpoints.multimodal import load_multimodal_reference, random_audio
from tests.checkpoints.shared import one_thread

SECONDS = (1.3, 0.7)
# Measured: at most 1.5e-6 apart (values up to ~3.6), the last few float32 bits, mostly the engine's one-pass
# RMSNorm (aten.cpp) against Transformers' composite; a clip alone differs from it batched as little (other
# matmul shapes).
TOLERANCE = dict(atol=5e-6, rtol=1e-6)
# In bfloat16 the tokens measured bit-identical; one bfloat16 step (2^-7 relative) is allowed, and 95%
# must be identical.
BF16_TOLERANCE = dict(atol=1e-2, rtol=2**-7)


@pytest.fixture(scope="module")
def audio(multimodal_checkpoint):
    d = str(multimodal_checkpoint)
    processor = AutoProcessor.from_pretrained(d)
    clips = [random_audio(s, seed=i) for i, s in enumerate(SECONDS)]
    return {
        "processor": processor,
        "reference": load_multimodal_reference(d),
        "encoder": gemma_engine.Encoder(d, dtype="float32"),
        "clips": clips,
        "batch": features(processor, clips),
    }


def features(processor, clips) -> tuple[torch.Tensor, torch.Tensor]:
    """The feature extractor's (input_features [n, frames, mel], input_features_mask [n, frames]), padded."""
    out = processor.feature_extractor(clips, return_tensors="pt", padding="longest")
    return out["input_features"], out["input_features_mask"]


def reference_tokens(model, feats, mask) -> list[torch.Tensor]:
    """Transformers' soft tokens per clip: `pooler_output` where the tower's mask is true."""
    with one_thread(), torch.no_grad():
        out = model.model.get_audio_features(feats, mask)
    return [out.pooler_output[i][out.attention_mask[i]] for i in range(feats.shape[0])]


def test_audio_soft_tokens_are_transformers(audio):
    feats, mask = audio["batch"]
    # Both clips are padded (the longer one by its partial last frame): the masks matter.
    assert feats.shape[0] == 2 and bool((~mask).any(dim=1).all())
    expected = reference_tokens(audio["reference"], feats, mask)
    got = audio["encoder"].audio(feats, mask)
    assert [g.shape for g in got] == [e.shape for e in expected]
    assert expected[0].shape[0] > expected[1].shape[0] > 0
    worst = max((g - e).abs().max().item() for g, e in zip(got, expected))
    print(f"max abs difference to Transformers: {worst:.3g}")
    for g, e in zip(got, expected):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, e, **TOLERANCE)


def test_soft_token_counts_are_the_processors(audio):
    processor, encoder = audio["processor"], audio["encoder"]
    got = encoder.audio(*audio["batch"])
    for clip, soft in zip(audio["clips"], got):
        ids = processor(text=[f"Listen: {processor.audio_token}"], audio=[clip], return_tensors="pt")["input_ids"]
        assert int((ids == encoder.audio_token_id).sum()) == soft.shape[0]
    both = processor(text=[f"{processor.audio_token} and {processor.audio_token}"], audio=audio["clips"],
                     return_tensors="pt")["input_ids"]
    assert int((both == encoder.audio_token_id).sum()) == sum(s.shape[0] for s in got)


def test_padding_does_not_leak(audio):
    """A clip batched with a longer one, or with garbage in its padding frames, gives the soft tokens it gives
    alone (and Transformers gives alone)."""
    processor, encoder, reference = audio["processor"], audio["encoder"], audio["reference"]
    feats, mask = audio["batch"]
    batched = encoder.audio(feats, mask)
    noisy = feats.clone()
    noisy[~mask] = torch.randn(int((~mask).sum()), feats.shape[2], generator=torch.Generator().manual_seed(0)) * 10
    assert all(torch.equal(a, b) for a, b in zip(encoder.audio(noisy, mask), batched))
    for i, clip in enumerate(audio["clips"]):
        alone_feats, alone_mask = features(processor, [clip])
        alone = encoder.audio(alone_feats, alone_mask)
        assert len(alone) == 1 and alone[0].shape == batched[i].shape
        torch.testing.assert_close(batched[i], alone[0], **TOLERANCE)
        torch.testing.assert_close(alone[0], reference_tokens(reference, alone_feats, alone_mask)[0], **TOLERANCE)


def test_bfloat16_soft_tokens_are_transformers(audio, multimodal_checkpoint):
    """The same in bfloat16, where each op must round where Transformers' does (F.glu, the biased output_proj)."""
    feats, mask = audio["batch"]
    d = str(multimodal_checkpoint)
    expected = reference_tokens(load_multimodal_reference(d, torch.bfloat16), feats.to(torch.bfloat16), mask)
    got = gemma_engine.Encoder(d, dtype="bfloat16").audio(feats, mask)
    assert [g.shape for g in got] == [e.shape for e in expected]
    exact = sum(int((g == e).sum()) for g, e in zip(got, expected)) / sum(e.numel() for e in expected)
    print(f"bfloat16: {exact:.1%} of values identical to Transformers'")
    # Rounding twice where Transformers rounds once (a * sigmoid(b) for F.glu) left 22% identical.
    assert exact > 0.95
    for g, e in zip(got, expected):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, e, **BF16_TOLERANCE)
