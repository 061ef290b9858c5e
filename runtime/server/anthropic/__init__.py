"""The Anthropic Messages API (routes.py), a translation over the chat-completion path, and its
streamed events (stream.py)."""
