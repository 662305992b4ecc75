"""OpenAI-compatible server over the Rust engine."""
