"""Chat templates render exactly as transformers renders them, inside a sandbox that stops
templates from reaching Python internals, and reject malformed messages clearly."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from kvserve.engine.text.chat_template import ChatTemplate, ChatTemplateError, validate_messages
from kvserve.engine.text.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Write a haiku about 🐍."},
        {"role": "assistant", "content": "Silent scales glisten\n日本の庭\n"},
        {"role": "user", "content": "  Another, with   odd spacing\t\n"},
    ],
]

# A template in the style of recent instruct models: tools rendered with tojson, a date from
# strftime_now, loop controls, namespace, raise_exception and the {% generation %} tag.
RICH_TEMPLATE = """\
{%- set ns = namespace(system=none) -%}
{%- if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% endif -%}
<|start|>{{ bos_token }}{{ ns.system or 'Default system' }}
{%- if tools %}
Tools: {{ tools | tojson }}
{%- endif %}
{% for message in messages %}
{%- if message['role'] == 'system' %}{% continue %}{% endif -%}
{%- if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('Unknown role: ' + message['role']) }}{% endif -%}
<{{ message['role'] }}>
{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}
{%- else %}{{ message['content'] }}{% endif %}{{ eos_token }}
{% endfor -%}
{%- if add_generation_prompt %}<assistant>{% endif -%}
"""


@pytest.fixture(scope="module")
def tokenizer(smollm2_source) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_source.path)


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(tokenizer: Tokenizer, hf_smollm2_tokenizer, messages,
                                               add_generation_prompt: bool) -> None:
    expected = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_smollm2_template_injects_its_default_system_prompt(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                      "<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode(prompt)[0] == 1  # <|im_start|> is one special token


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rich_template_matches_transformers_renderer(add_generation_prompt: bool) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "system", "content": "Be nice. ünïcode ✓"}, *CONVERSATIONS[2]]
    tools = [{"type": "function", "function": {"name": "weather", "description": "Météo",
                                               "parameters": {"type": "object", "properties": {}}}}]
    ours = ChatTemplate(RICH_TEMPLATE, bos_token="<s>", eos_token="</s>").render(
        messages, add_generation_prompt=add_generation_prompt, tools=tools)
    theirs = render_jinja_template([messages], tools=tools, chat_template=RICH_TEMPLATE,
                                   add_generation_prompt=add_generation_prompt, bos_token="<s>", eos_token="</s>")
    theirs = theirs[0][0] if isinstance(theirs, tuple) else theirs[0]
    assert ours == theirs
    assert "Météo" in ours  # tojson keeps non-ASCII text


def test_raise_exception_becomes_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="Unknown role: tool"):
        ChatTemplate(RICH_TEMPLATE).render([{"role": "tool", "content": "42"}])


def test_strftime_now_is_available() -> None:
    rendered = ChatTemplate("{{ strftime_now('%Y') }}").render([{"role": "user", "content": "x"}])
    assert rendered.isdigit() and len(rendered) == 4


@pytest.mark.parametrize("escape", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ raise_exception.__globals__['__builtins__']['__import__']('os').system('true') }}",
    "{{ lipsum.__globals__['os'].listdir('/') }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
    "{{ messages[0].update({'role': 'system'}) }}",
])
def test_sandbox_blocks_escapes(escape: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(escape).render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("probe", ["{{ ''.__class__ }}", "{{ messages.__class__ }}", "{{ dict.__class__ }}"])
def test_unsafe_attributes_render_as_nothing(probe: str) -> None:
    assert ChatTemplate(probe).render([{"role": "user", "content": "x"}]) == ""


def test_messages_passed_in_are_not_mutated() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert ChatTemplate("{{ messages[0]['content'] }}").render(messages) == "a\nb"
    assert messages[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


@pytest.mark.parametrize(("messages", "message"), [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], r"messages\[0\] must be an object"),
    ([{"content": "no role"}], r"messages\[0\] needs a non-empty string 'role'"),
    ([{"role": "", "content": "x"}], "non-empty string 'role'"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([{"role": "user", "content": 3}], "must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
])
def test_bad_messages_are_rejected_clearly(messages, message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        validate_messages(messages)


def test_assistant_with_tool_calls_may_omit_content() -> None:
    checked = validate_messages([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
    assert checked[0]["content"] is None and checked[0]["tool_calls"] == [{"id": "1"}]


def test_template_errors_are_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="failed on these messages"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])


def test_model_without_template_says_what_to_do() -> None:
    bare = Tokenizer(HFTokenizer(models.BPE({"a": 0}, [])), bos_token_id=None, eos_token_id=None, chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template.*completions API"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
