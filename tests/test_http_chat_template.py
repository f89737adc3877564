"""Chat templates render as transformers' apply_chat_template renders them (Llama 3 and Qwen
styles), refuse by naming `messages`, stay in the sandbox, and load from tokenizer_config.json."""
from __future__ import annotations

import json
import os

import pytest

from helpers import save_byte_tokenizer
from specserve.engine.tokenizer import Tokenizer
from specserve.server.errors import InvalidRequest
from specserve.server.text.chat_template import ChatTemplate

LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Plain blocks (no whitespace control): transformers' trim_blocks/lstrip_blocks decide the output.
WHITESPACE_AND_FILTERS = """{% for message in messages %}
  {% if message.role == 'user' %}
[U] {{ message.content }} {{ {'len': message.content | length, 'tag': '<b>'} | tojson }}
  {% else %}
[A] {{ message.content }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}[A]{% endif %}"""

STRICT = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
          "{{ m.content }}{% endfor %}")

CONVERSATIONS = [
    [{"role": "user", "content": "hello  "}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo ✓"},
     {"role": "assistant", "content": "hi"}, {"role": "user", "content": "a & <b>"}],
]
SPECIAL = {"bos_token": "<bos>", "eos_token": "<eos>"}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    path = str(tmp_path_factory.mktemp("tok"))
    save_byte_tokenizer(path, 320)
    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"),
                                   **SPECIAL)


@pytest.mark.parametrize("template", [LLAMA3, QWEN, WHITESPACE_AND_FILTERS],
                         ids=["llama3", "qwen", "whitespace"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one", "four"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(hf_tokenizer, template, messages, add_generation_prompt):
    want = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)
    assert ChatTemplate(template, SPECIAL).render(messages, add_generation_prompt) == want


def test_raise_exception_names_messages():
    template = ChatTemplate(STRICT, {})
    assert template.render([{"role": "user", "content": "a"}]) == "a"
    with pytest.raises(InvalidRequest, match="^messages: .*roles must alternate"):
        template.render([{"role": "assistant", "content": "a"}])


def test_templates_run_in_the_sandbox():
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(InvalidRequest, match="^messages:"):
        escape.render([{"role": "user", "content": "a"}])
    mutate = ChatTemplate("{% set _ = messages.append(1) %}{{ messages | length }}", {})
    with pytest.raises(InvalidRequest, match="^messages:"):
        mutate.render([{"role": "user", "content": "a"}])


def test_loaded_from_the_model_folder(tmp_path):
    save_byte_tokenizer(str(tmp_path), 320)
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": {"content": "<bos>", "special": True}, "eos_token": "<eos>",
                   "chat_template": [{"name": "tool_use", "template": "x"},
                                     {"name": "default", "template": LLAMA3}]}, f)
    tokenizer = Tokenizer(str(tmp_path), [2])
    rendered = ChatTemplate.of(tokenizer).render(CONVERSATIONS[0])
    assert rendered.startswith("<bos><|start_header_id|>user")
    # Rendered text carries its BOS: tokenized without special tokens, it has exactly one.
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids.count(1) == 1 and ids[0] == 1


def test_demo_model_has_a_chat_template():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tokenizer = Tokenizer(os.path.join(repo, "models", "demo-target"), [])
    rendered = ChatTemplate.of(tokenizer).render(CONVERSATIONS[1])
    assert rendered.startswith(tokenizer.special_tokens["bos_token"])
    assert "héllo ✓" in rendered


def test_no_template():
    class Plain:
        chat_template = None

    assert ChatTemplate.of(Plain()) is None
