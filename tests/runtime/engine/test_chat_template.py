"""Chat template variables: ``variables`` reach the template (llama-server's
``chat_template_kwargs``, ``enable_thinking``), and firefunction-v2's template gets the
``datetime`` and ``functions`` llama.cpp gives it."""
from __future__ import annotations

import json
from datetime import datetime

from runtime.engine.chat import ChatTemplate

MESSAGES = [{"role": "user", "content": "What is today?"}]


def test_variables_reach_the_template():
    t = ChatTemplate("{{ messages[0]['content'] }}{% if enable_thinking is defined %}"
                     "[{{ enable_thinking }}]{% endif %}", bos_token="", eos_token="")
    assert t.render(MESSAGES) == "What is today?"
    assert t.render(MESSAGES, variables={"enable_thinking": False}) == "What is today?[False]"


def test_firefunction_gets_datetime_and_functions():
    source = ("{# functools[ marks firefunction-v2 #}{{ 'Today is ' + datetime + '.' }}"
              "|{{ functions }}")
    t = ChatTemplate(source, bos_token="", eos_token="")
    today = datetime.now().strftime("%b %d %Y")
    assert t.render(MESSAGES).startswith(f"Today is {today}") and t.render(MESSAGES).endswith("|")
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert t.render(MESSAGES, tools=tools).endswith("|" + json.dumps(tools, indent=2))
