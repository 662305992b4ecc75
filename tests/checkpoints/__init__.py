"""Deterministic tiny Gemma 4 checkpoints for tests and the demo, built with Transformers.

Everything is derived from a fixed seed, so two builds write the same bytes. The architecture follows
``transformers/models/gemma4/{configuration,modeling}_gemma4.py`` (Transformers 5.18); the tiny config switches
on every feature E2B uses. One module per kind of checkpoint, each documenting its files:

* ``text``: the tiny text configs (``tiny_text_config``, the 12B's ``tiny_unified_text_config``), the random
  model (``random_model``), the dense bf16 checkpoint (``save_dense``) and its two-token copy (``save_two_token``).
* ``quantized``: compressed-tensors W4A16 linears (``save_w4a16``) and int4 vocabulary tables
  (``save_w4a16_emb4``, ``dequantize_emb4_tables``), from the same random model.
* ``parity``: what the engine's parity tests compare with: the Transformers references (``load_hf_reference``,
  ``greedy_reference``), ``PARITY_PROMPT``, the margins asserted on them and the seed search behind ``SEED``.
* ``chat``: the demo's chat checkpoint (``save_chat``): Gemma's turn markers and a tokenizer trained here.
* ``agent``: Gemma 4's tool and thinking markers (``save_agent_chat``), and the same weights under Google's own
  Gemma 4 template (``save_gemma4_chat``).
* ``multimodal``: both towers, image and audio (``save_multimodal``), and deterministic inputs for them
  (``random_image``, ``random_audio``).
* ``shared``: what the kinds share: ``one_thread``, the layer type names, the byte-level tokenizer recipe and
  its writer.
* ``fixtures``: the session fixtures (``dense_checkpoint``, ``chat_checkpoint``, ...), a pytest plugin that
  tests/conftest.py registers.
* ``__main__``: ``python -m tests.checkpoints --kind chat --out DIR`` writes one checkpoint.
"""
