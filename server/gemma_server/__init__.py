"""OpenAI-compatible server over the Rust engine (`gemma_engine`). Run it with `python -m gemma_server`."""

__version__ = "0.1.0"
