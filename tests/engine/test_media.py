"""Images in the engine's prompts (rust/src/gemma4/vision.rs, rust/src/engine/media.rs) against Transformers
on the tiny checkpoint with both towers (tests/checkpoints/multimodal.py `save_multimodal`), in float32.

The prompts are what Transformers' own Gemma4Processor makes of a chat with images; the reference is the
plain `Gemma4ForConditionalGeneration.from_pretrained(dir, dtype=torch.float32)` with `generate`. The
engine gets the same ids and the soft tokens of `gemma_engine.Encoder`, placed over the image
placeholders (`Request(media=...)`); audio prompts likewise (the tower alone: test_audio_tower.py). A second
checkpoint sets
`use_bidirectional_attention="vision"`, as the larger Gemma 4 models do: its sliding layers read an image's
soft tokens both ways, and the engine's prompt chunks never cut an image.
"""

import hashlib
import json

import pytest
import torch
from transformers import AutoProcessor

import gemma_engine
from tests.checkpoints.multimodal import load_multimodal_reference, random_audio, random_image
from tests.checkpoints.parity import top2_margins
from tests.checkpoints.shared import one_thread
from tests.engine.test_prefix_cache import cached, serve

MAX_NEW = 32
CONTEXT = 512
# The smallest top-1/top-2 logit gap a greedy reference step may have for token equality to be a fair test.
MIN_MARGIN = 1e-3


def load(d, **engine_kwargs) -> dict:
    """A checkpoint's processor (Gemma4Processor), reference, encoder and a float32 engine."""
    d = str(d)
    return {
        "processor": AutoProcessor.from_pretrained(d),
        "reference": load_multimodal_reference(d),
        "encoder": gemma_engine.Encoder(d, dtype="float32"),
        "engine": gemma_engine.Engine(d, dtype="float32", like=torch.zeros(1), context=CONTEXT, max_batch=4,
                                      **engine_kwargs),
    }


@pytest.fixture(scope="module")
def mm(multimodal_checkpoint):
    return load(multimodal_checkpoint)


def chat_inputs(processor, images, text):
    """Gemma4Processor's tensors for one user turn holding `images` then `text`, with the generation prompt."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    return processor(text=prompt, images=images or None, return_tensors="pt")


def image_key(image) -> int:
    """A 63-bit key of an image's pixels (the server hashes the file's bytes)."""
    return int.from_bytes(hashlib.sha256(image.tobytes()).digest()[:8], "little") >> 1


def media_of(encoder, inputs, images) -> list[tuple[int, torch.Tensor, int]]:
    """(start, soft tokens, key) for each run of image placeholders in `inputs`, in order."""
    if not images:
        return []
    soft = encoder.image(inputs["pixel_values"], inputs["image_position_ids"])
    ids = inputs["input_ids"][0].tolist()
    starts = [i for i, t in enumerate(ids) if t == encoder.image_token_id and (i == 0 or ids[i - 1] != t)]
    assert [s.shape[0] for s in soft] == [sum(1 for _ in _run(ids, s)) for s in starts]
    return [(s, t, image_key(im)) for s, t, im in zip(starts, soft, images, strict=True)]


def _run(ids, start):
    i = start
    while i < len(ids) and ids[i] == ids[start]:
        yield i
        i += 1


def reference_greedy(model, inputs, max_new=MAX_NEW):
    """Transformers' greedy tokens and each step's float32 logits."""
    with one_thread(), torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, torch.cat([s.float() for s in out.logits])


def until_eos(tokens, eos):
    """`tokens` cut as the engine cuts them: an eos id ends the run and is not returned."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


@pytest.fixture(scope="module")
def cases(mm):
    """Two image prompts: one image, and two images of other sizes."""
    images = [random_image(40, 30, 0), random_image(20, 36, 1), random_image(48, 48, 2)]
    specs = {"one": ([images[0]], "What is in this picture?"), "two": (images[1:], "Compare them.")}
    out = {}
    for name, (imgs, text) in specs.items():
        inputs = chat_inputs(mm["processor"], imgs, text)
        tokens, logits = reference_greedy(mm["reference"], inputs)
        out[name] = {"ids": inputs["input_ids"][0].tolist(), "media": media_of(mm["encoder"], inputs, imgs),
                     "tokens": tokens, "logits": logits}
    return out


def test_the_encoder_soft_tokens_equal_transformers_get_image_features(mm):
    images = [random_image(40, 30, 0), random_image(20, 36, 1)]
    inputs = mm["processor"].image_processor(images, return_tensors="pt")
    ours = mm["encoder"].image(inputs["pixel_values"], inputs["image_position_ids"])
    with torch.no_grad():
        ref = mm["reference"].model.get_image_features(inputs["pixel_values"], inputs["image_position_ids"])
    assert [t.shape[0] for t in ours] == inputs["num_soft_tokens_per_image"].tolist()
    for a, b in zip(ours, ref.pooler_output, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["one", "two"])
def test_an_image_prompt_gives_transformers_greedy_tokens_and_first_token_distribution(mm, cases, name):
    case = cases[name]
    eos = set(mm["engine"].eos_ids)
    margins = top2_margins(case["logits"])
    assert margins.min().item() > MIN_MARGIN, "the reference has a near tie; the test would prove nothing"
    expected = until_eos(case["tokens"], eos)
    assert len(expected) == MAX_NEW, f"the reference ended early ({len(expected)} tokens)"
    served = serve(mm["engine"], [gemma_engine.Request(1, case["ids"], MAX_NEW, media=case["media"])])
    assert served.results[1].tokens == expected
    divergence = kl(case["logits"][0], mm["engine"].logits(case["ids"], media=case["media"]))
    assert divergence <= 1e-5, divergence


def kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || ours) of two logit vectors."""
    p_ref, p_ours = torch.log_softmax(reference_logits, -1), torch.log_softmax(logits, -1)
    return torch.sum(p_ref.exp() * (p_ref - p_ours)).item()


def test_the_same_ids_without_the_soft_tokens_give_another_distribution(mm, cases):
    """The soft tokens reach the model: the same prompt with pad ids where the soft tokens go moves the first
    token's distribution far past the parity bound."""
    case = cases["one"]
    image = mm["encoder"].image_token_id
    text_only = mm["engine"].logits([0 if t == image else t for t in case["ids"]])
    assert kl(case["logits"][0], text_only) > 1e-2


def test_image_prompts_batched_together_and_beside_text_each_get_their_tokens_alone(mm, cases):
    engine = mm["engine"]
    eos = set(engine.eos_ids)
    text_prompt = [2, 3, 40, 41, 42, 43, 4]
    requests = [gemma_engine.Request(1, cases["one"]["ids"], MAX_NEW, media=cases["one"]["media"]),
                gemma_engine.Request(2, text_prompt, 8),
                gemma_engine.Request(3, cases["two"]["ids"], MAX_NEW, media=cases["two"]["media"])]
    served = serve(engine, requests)
    assert served.results[1].tokens == until_eos(cases["one"]["tokens"], eos)
    assert served.results[3].tokens == until_eos(cases["two"]["tokens"], eos)
    alone = serve(engine, [gemma_engine.Request(4, text_prompt, 8)])
    assert served.results[2].tokens == alone.results[4].tokens


def test_the_prefix_cache_reuses_the_same_image_and_never_another(multimodal_checkpoint, mm, cases):
    """The same image prompt again resumes at its last token; the same ids with another image of the same
    size resume at most up to the image's first soft token; the tokens stay Transformers' either way."""
    engine = gemma_engine.Engine(str(multimodal_checkpoint), dtype="float32", like=torch.zeros(1), context=CONTEXT,
                                 max_batch=2)
    eos = set(engine.eos_ids)
    case = cases["one"]
    image_start = case["media"][0][0]
    first = serve(engine, [gemma_engine.Request(1, case["ids"], MAX_NEW, media=case["media"])])
    assert first.results[1].tokens == until_eos(case["tokens"], eos)
    again = serve(engine, [gemma_engine.Request(2, case["ids"], MAX_NEW, media=case["media"])])
    assert cached(again.results[2]) == len(case["ids"]) - 1
    assert again.results[2].tokens == first.results[1].tokens
    other = random_image(40, 30, 7)
    inputs = chat_inputs(mm["processor"], [other], "What is in this picture?")
    assert inputs["input_ids"][0].tolist() == case["ids"]
    media = media_of(mm["encoder"], inputs, [other])
    expected, _ = reference_greedy(mm["reference"], inputs)
    assert until_eos(expected, eos) != first.results[1].tokens, "the other image must change the reply"
    miss = serve(engine, [gemma_engine.Request(3, case["ids"], MAX_NEW, media=media)])
    assert cached(miss.results[3]) <= image_start
    assert miss.results[3].tokens == until_eos(expected, eos)


def test_media_that_break_the_rules_end_the_request_with_an_error_naming_them(mm, cases, agent_checkpoint):
    case = cases["one"]
    start, soft, key = case["media"][0]
    engine = mm["engine"]
    bad = {
        "misplaced": [(start - 1, soft, key)],
        "too wide": [(start, torch.zeros(soft.shape[0], soft.shape[1] + 1), key)],
        "missing": [],
    }
    expected = {"misplaced": "media[0]", "too wide": "media[0]: soft tokens must be", "missing": "with no media there"}
    for i, (name, media) in enumerate(bad.items()):
        served = serve(engine, [gemma_engine.Request(10 + i, case["ids"], 4, media=media)])
        r = served.results[10 + i]
        assert r.finish == "error" and expected[name] in r.error, (name, r.error)
    text_only = gemma_engine.Engine(str(agent_checkpoint), dtype="float32", like=torch.zeros(1), context=CONTEXT)
    served = serve(text_only, [gemma_engine.Request(20, [2, 15, 15, 3], 4, media=[(1, soft[:2], key)])])
    assert served.results[20].finish == "error" and "text only" in served.results[20].error
    with pytest.raises(ValueError, match="no vision tower"):
        gemma_engine.Encoder(str(agent_checkpoint), dtype="float32").image(torch.zeros(1, 4, 48),
                                                                           torch.zeros(1, 4, 2, dtype=torch.long))


def test_a_tower_config_key_of_the_wrong_type_is_a_value_error_naming_its_path(multimodal_checkpoint, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in multimodal_checkpoint.iterdir():
        if f.name != "config.json":
            (bad / f.name).symlink_to(f)
    config = json.loads((multimodal_checkpoint / "config.json").read_text())
    config["vision_config"]["rope_parameters"]["rope_theta"] = "100"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: vision_config.rope_parameters.rope_theta: must be a number"):
        gemma_engine.Encoder(str(bad), dtype="float32")


@pytest.mark.parametrize("chunk", [16, 256])
def test_with_bidirectional_image_attention_prompts_read_in_chunks_or_groups_give_transformers_tokens(
        multimodal_bidirectional_checkpoint, chunk):
    """`use_bidirectional_attention="vision"`: Transformers' sliding layers let an image's soft tokens see
    each other (`create_masks_for_vision_model`, fed the processor's mm_token_type_ids). The engine matches it
    with 16-token chunks (each image read in one chunk past the budget) and with whole prompts read
    together, and the same prompts read causally would not."""
    mb = load(multimodal_bidirectional_checkpoint, prefill_chunk=chunk)
    engine, eos = mb["engine"], set(mb["engine"].eos_ids)
    images = [[random_image(40, 30, 0)], [random_image(20, 36, 1), random_image(48, 48, 2)]]
    requests, expected = [], {}
    for i, imgs in enumerate(images):
        inputs = chat_inputs(mb["processor"], imgs, "What is in this picture?")
        tokens, logits = reference_greedy(mb["reference"], inputs)
        assert top2_margins(logits).min().item() > MIN_MARGIN
        ids, media = inputs["input_ids"][0].tolist(), media_of(mb["encoder"], inputs, imgs)
        requests.append(gemma_engine.Request(i, ids, MAX_NEW, media=media))
        expected[i] = until_eos(tokens, eos)
        assert kl(logits[0], engine.logits(ids, media=media)) <= 1e-5
        causal = dict(inputs)
        causal.pop("mm_token_type_ids")  # Transformers then reads the images causally
        assert kl(logits[0], reference_greedy(mb["reference"], causal, 1)[1][0]) > 1e-2
    served = serve(engine, requests)
    assert {i: r.tokens for i, r in served.results.items()} == expected


@pytest.mark.gpu
def test_on_cuda_the_encoder_and_an_image_prompt_give_transformers_tokens(multimodal_checkpoint, mm, cases):
    """The towers and the soft tokens' placement on CUDA in float32 against Transformers on the CPU."""
    d, cuda = str(multimodal_checkpoint), torch.zeros(1, device="cuda")
    encoder = gemma_engine.Encoder(d, like=cuda, dtype="float32")
    engine = gemma_engine.Engine(d, like=cuda, dtype="float32", context=CONTEXT, max_batch=2)
    images = [random_image(40, 30, 0)]
    inputs = chat_inputs(mm["processor"], images, "What is in this picture?")
    media = media_of(encoder, inputs, images)
    assert media[0][1].device.type == "cuda"
    case = cases["one"]
    served = serve(engine, [gemma_engine.Request(1, case["ids"], MAX_NEW, media=media)])
    assert served.results[1].tokens == until_eos(case["tokens"], set(engine.eos_ids))
    assert kl(case["logits"][0], engine.logits(case["ids"], media=media)) <= 1e-5


def test_a_w4a16_checkpoint_with_quantized_towers_gives_transformers_tokens(multimodal_w4a16_checkpoint):
    """Int4 pack-quantized tower linears (compressed-tensors, groups of 16) load dequantized, as Transformers'
    plain load decompresses them."""
    from safetensors import safe_open

    files = list(multimodal_w4a16_checkpoint.glob("*.safetensors"))
    with safe_open(str(files[0]), "pt") as f:
        names = set(f.keys())
    assert "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight_packed" in names
    assert "model.embed_vision.embedding_projection.weight_packed" in names
    mq = load(multimodal_w4a16_checkpoint)
    images = [random_image(40, 30, 0)]
    inputs = chat_inputs(mq["processor"], images, "What is in this picture?")
    tokens, logits = reference_greedy(mq["reference"], inputs)
    assert top2_margins(logits).min().item() > MIN_MARGIN
    ids, media = inputs["input_ids"][0].tolist(), media_of(mq["encoder"], inputs, images)
    served = serve(mq["engine"], [gemma_engine.Request(1, ids, MAX_NEW, media=media)])
    assert served.results[1].tokens == until_eos(tokens, set(mq["engine"].eos_ids))
    assert kl(logits[0], mq["engine"].logits(ids, media=media)) <= 1e-5


def audio_chat_inputs(processor, clips, text):
    """Gemma4Processor's tensors for one user turn holding audio `clips` then `text`."""
    content = [{"type": "audio"} for _ in clips] + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    return processor(text=prompt, audio=clips, return_tensors="pt")


def runs_of(ids, token):
    """The starts of each run of `token` in `ids`."""
    return [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != t)]


def test_an_audio_prompt_gives_transformers_greedy_tokens_and_first_token_distribution(mm):
    clips = [random_audio(1.3, 0), random_audio(0.7, 1)]
    inputs = audio_chat_inputs(mm["processor"], clips, "Transcribe this.")
    tokens, logits = reference_greedy(mm["reference"], inputs)
    assert top2_margins(logits).min().item() > MIN_MARGIN
    expected = until_eos(tokens, set(mm["engine"].eos_ids))
    assert len(expected) == MAX_NEW, f"the reference ended early ({len(expected)} tokens)"
    ids = inputs["input_ids"][0].tolist()
    soft = mm["encoder"].audio(inputs["input_features"], inputs["input_features_mask"])
    starts = runs_of(ids, mm["encoder"].audio_token_id)
    media = [(s, t, 100 + i) for i, (s, t) in enumerate(zip(starts, soft, strict=True))]
    served = serve(mm["engine"], [gemma_engine.Request(1, ids, MAX_NEW, media=media)])
    assert served.results[1].tokens == expected
    assert kl(logits[0], mm["engine"].logits(ids, media=media)) <= 1e-5
