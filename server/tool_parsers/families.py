"""Per-family parsers for tool_choice "auto", by vLLM's --tool-call-parser names: how each model
family writes a call in free text (each module's docstring shows its format).

    hermes        Hermes 2 Pro, Qwen 2.5/3     <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json   Llama 3.1-3.3                [<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]
    mistral       Mistral (tokenizer < v11)    [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
                  Mistral (tokenizer v11+)     [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}

Every parser keeps the text outside the calls as content, and anything that does not parse as
a call stays text, markers included: a malformed call never fails the request.
"""

from __future__ import annotations

from kvserve.server.tool_parsers.hermes import parse_hermes
from kvserve.server.tool_parsers.llama3_json import parse_llama3_json
from kvserve.server.tool_parsers.mistral import parse_mistral
from kvserve.server.tool_parsers.segments import OutputParser

TOOL_CALL_PARSERS: dict[str, OutputParser] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}
