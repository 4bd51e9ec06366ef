"""Chat templates that list tools the way real models' do, for tests of native tool calling on the tiny
models of :mod:`cacheblend_rag.testing` (set one as ``tokenizer.chat_template``, or take
:func:`tiny_tool_engine`). The templates keep the tool parts of the originals and drop the rest.
"""

from __future__ import annotations

from typing import Any

# Qwen2.5-Instruct's template: tools listed in the system turn, calls as <tool_call> blocks, results as
# <tool_response> blocks of a user turn.
QWEN25_TOOLS_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Llama 3.1/3.2-Instruct's template: tools listed as JSON in the first user turn, a call answered as
# {"name": ..., "parameters": ...}, one per assistant message, results in "ipython" turns. This variant also
# writes each result's tool_call_id, as templates that track ids do (Mistral's), so tests can see ids pass.
LLAMA31_TOOLS_TEMPLATE = """{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- if tools is not none %}
{%- if messages | length != 0 %}{%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}{%- endif %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
{{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n" }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls|length == 1 %}{{- raise_exception("This model only supports single tool-calls at once!") }}{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}<|eot_id|>" }}
{%- elif message.role == "tool" or message.role == "ipython" %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
{%- if message.tool_call_id is defined %}{{- '[' + message.tool_call_id + '] ' }}{%- endif %}
{{- message.content }}{{- "<|eot_id|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

TOOL_TEMPLATES = {"qwen2.5": QWEN25_TOOLS_TEMPLATE, "llama3.1": LLAMA31_TOOLS_TEMPLATE}


def tiny_tool_engine(style: str, arch: str = "qwen2") -> Any:
    """A tiny engine (:func:`cacheblend_rag.testing.tiny_engine`) whose chat template lists tools as
    ``style``'s does: ``"qwen2.5"`` (``<tool_call>`` blocks) or ``"llama3.1"`` (JSON with "parameters")."""
    from cacheblend_rag.testing import tiny_engine

    if style not in TOOL_TEMPLATES:
        raise ValueError(f"style={style!r}; choose one of {sorted(TOOL_TEMPLATES)}")
    engine = tiny_engine(arch)
    engine.tokenizer.chat_template = TOOL_TEMPLATES[style]
    return engine


__all__ = ["LLAMA31_TOOLS_TEMPLATE", "QWEN25_TOOLS_TEMPLATE", "TOOL_TEMPLATES", "tiny_tool_engine"]
