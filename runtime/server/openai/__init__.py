"""The OpenAI routes of their own: ``/v1/chat/completions`` and ``/v1/completions``
(completions.py). The request bodies (schemas.py), the chat stream's frames (chat_stream.py)
and the queued jobs are shared with the other APIs, one level up."""
