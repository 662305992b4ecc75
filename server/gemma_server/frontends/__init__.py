"""The APIs a client speaks, each a way in and a format out, above the request path (state.py) and the way
out (serving.py): chat and completions (OpenAI's; `chat`), Responses (`responses`), Anthropic's Messages
(`messages`), the Audio API's transcriptions and translations (`transcriptions`), and MCP (`mcp_server`).

Every generating API becomes a chat or completion request and takes `ServerState.start`; its reply goes
through `serving.reply` with the API's `serving.Format`. The routes themselves are in app.py.
"""
