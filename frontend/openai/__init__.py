"""OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions."""
