"""Reading tool calls out of a model's text: per-family parsers for tool_choice "auto"
(families.py lists them: hermes.py, llama3_json.py, mistral.py), the shapes the grammar forces
for "required" and named calls (forced.py), and the streaming diff that turns a growing text
into OpenAI's tool-call deltas (stream.py)."""

from kvserve.server.tool_parsers.call_ids import FAMILY_CALL_IDS, new_call_id
from kvserve.server.tool_parsers.families import TOOL_CALL_PARSERS
from kvserve.server.tool_parsers.forced import named_call_parser, parse_required
from kvserve.server.tool_parsers.segments import (CallSegment, OutputParser, ParsedCall, ParsedMessage, Segment,
                                                  TextSegment, parsed_message)
from kvserve.server.tool_parsers.stream import StreamDelta, ToolCallStream

__all__ = ["FAMILY_CALL_IDS", "TOOL_CALL_PARSERS", "CallSegment", "OutputParser", "ParsedCall", "ParsedMessage", "Segment",
           "StreamDelta", "TextSegment", "ToolCallStream", "named_call_parser", "new_call_id", "parse_required",
           "parsed_message"]
