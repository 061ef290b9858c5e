"""What the translated-API tests (Anthropic Messages, OpenAI Responses) share: a three-turn
conversation and a weather tool's JSON schema."""
from __future__ import annotations

N_CTX = 2048
SYSTEM = "You are terse."
TURNS = [{"role": "user", "content": "Hello"},
         {"role": "assistant", "content": "Hi there!"},
         {"role": "user", "content": "How are you?"}]
WEATHER_SCHEMA = {"type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 16},
                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
