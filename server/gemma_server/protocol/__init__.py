"""What a request means: the OpenAI-shaped request and reply models and the bounds they are held to.

- `limits`: the bounds every request is held to (the engine's own, copied; the server's), named once.
- `base`: the model every request derives from (unknown fields kept and logged) and JSON integers.
- `content`: what a chat message holds (text, image and audio parts, tool calls), tools and response formats.
- `requests`: chat completions and completions (`GenerationRequest` and its two APIs): checks, prompts, and
  what the engine gets.
- `engine`: `EngineParams`, a request as the engine takes it.
- `replies`: the response objects, usage and log-probabilities; the model list.
- `tokenize`: /tokenize and /detokenize.
"""
