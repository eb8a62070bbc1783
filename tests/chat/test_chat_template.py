"""Chat templates: our ChatML+tools template, token-in/token-out turns, template choice and the sandbox."""

import pytest

from agentrl.chat import ChatFormat, parse_tool_calls
from agentrl.env import function_schema
from agentrl.chat.template import SecurityError, TemplateError, render, select_template
from agentrl.tokenizer import byte_tokenizer

IM_END, ENDOFTEXT, TOOL_CALL_END = 258, 256, 260


def search(query: str, k: int = 3) -> str:
    """Search the corpus.

    Args:
        query: words to look for.
        k: number of results.
    """


TOOLS = [function_schema(search)]
PROMPT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of France?"}]
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "France capital"}}\n</tool_call>'


def tool_msg(content):
    return {"role": "tool", "name": "search", "content": content}


def conversation(fmt, turns):
    """Token-in/token-out over `turns` of (generated ids, tool messages); returns (ids, messages, inputs)."""
    ids = fmt.prompt_ids(PROMPT)
    messages, inputs = list(PROMPT), []
    for generated, tools in turns:
        inputs.append(list(ids))
        ids = ids + generated
        messages.append({"role": "assistant", "content": fmt.decode(generated)})
        if tools:
            ids = ids + fmt.suffix_ids(tools, generated)
            messages.extend(tools)
    return ids, messages, inputs


def three_turns(fmt):
    eos = fmt.end_of_turn_id
    return [
        (fmt.encode(CALL) + [eos], [tool_msg("Paris is the capital of France.")]),  # ended on end-of-turn
        (fmt.encode("Let me check twice.\n" + CALL), [tool_msg("1. Paris"), tool_msg("2. Lyon")]),  # stopped on </tool_call>
        (fmt.encode("Paris.") + [eos], None),
    ]


def test_our_template_renders_tools_and_turns():
    fmt = ChatFormat(byte_tokenizer(), TOOLS)
    assert fmt.template_name == "chatml_tools"
    text = fmt.render(PROMPT + [{"role": "assistant", "content": CALL}, tool_msg("a"), tool_msg("b")],
                      add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nAnswer briefly.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "search", "description": "Search the corpus."' in text
    assert text.endswith("<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n" + CALL
                         + "<|im_end|>\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    no_tools = ChatFormat(byte_tokenizer(), None).render(PROMPT)
    assert no_tools == "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"


def test_structured_tool_calls_render_like_the_generated_text():
    fmt = ChatFormat(byte_tokenizer(), TOOLS)
    structured = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": {"query": "France capital"}}}]}
    assert fmt.render(PROMPT + [structured]) == fmt.render(PROMPT + [{"role": "assistant", "content": CALL}])
    assert parse_tool_calls(CALL) == [{"name": "search", "arguments": {"query": "France capital"}}]


def test_three_turns_token_in_token_out_equal_the_full_render():
    fmt = ChatFormat(byte_tokenizer(), TOOLS)
    ids, messages, inputs = conversation(fmt, three_turns(fmt))
    for n, turn_input in enumerate(inputs):  # each turn's input is exactly the render up to that turn
        upto = [i for i, m in enumerate(messages) if m["role"] == "assistant"][n]
        assert turn_input == fmt.encode(fmt.render(messages[:upto], add_generation_prompt=True))
    assert ids + fmt.encode("\n") == fmt.encode(fmt.render(messages))


def test_suffix_closes_the_turn_only_when_the_model_did_not():
    fmt = ChatFormat(byte_tokenizer(), TOOLS)
    body = fmt.encode(CALL)
    with_eos = fmt.suffix_ids([tool_msg("r")], body + [IM_END])
    without = fmt.suffix_ids([tool_msg("r")], body)
    assert without == [IM_END] + with_eos
    assert fmt.decode(with_eos) == "\n<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # another eos (here <|endoftext|>) was seen by the model as is; the template's own close still follows
    assert fmt.suffix_ids([tool_msg("r")], body + [ENDOFTEXT]) == without
    assert fmt.suffix_ids([tool_msg("r")], []) == without


def test_token_facts_of_the_byte_tokenizer():
    fmt = ChatFormat(byte_tokenizer(), TOOLS)
    assert fmt.end_of_turn == "<|im_end|>" and fmt.eos_token_ids == [IM_END]
    assert fmt.stop_sequences == [[TOOL_CALL_END]] and fmt.stop_strings == ["</tool_call>"]
    assert fmt.decode(fmt.encode("hi") + [IM_END]) == "hi"
    assert fmt.decode(fmt.encode("hi") + [IM_END], strip_eos=False) == "hi<|im_end|>"
    assert ChatFormat(byte_tokenizer(), []).stop_sequences == []


# A Qwen3-style template that drops the reasoning of every assistant turn but the last: not prefix-preserving.
THINK_STRIPPING = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1].lstrip('\\n') }}"
    "{%- else %}{{ m.content }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_template_that_rewrites_history_does_not_change_what_the_model_saw():
    fmt = ChatFormat(byte_tokenizer(), TOOLS, template=THINK_STRIPPING)
    eos = fmt.end_of_turn_id
    turns = [
        (fmt.encode("<think>France, so Paris.</think>\n" + CALL) + [eos], [tool_msg("Paris.")]),
        (fmt.encode("<think>Confirmed.</think>\nParis") + [eos], None),
    ]
    ids, messages, inputs = conversation(fmt, turns)
    seen = fmt.decode(inputs[1], strip_eos=False)
    assert "<think>France, so Paris.</think>" in seen  # what the model read at turn 2 keeps its reasoning
    full = fmt.render(messages[:-1], add_generation_prompt=True)
    assert "France, so Paris." not in full and fmt.encode(full) != inputs[1]  # a full re-render would differ
    assert inputs[1] == inputs[0] + turns[0][0] + fmt.suffix_ids(turns[0][1], turns[0][0])
    assert fmt.decode(ids).endswith("<|im_start|>tool\nParis.<|im_end|>\n<|im_start|>assistant\n"
                                    "<think>Confirmed.</think>\nParis")


def test_template_that_alters_assistant_text_is_reported():
    fmt = ChatFormat(byte_tokenizer(), TOOLS, template="{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    with pytest.raises(TemplateError, match="verbatim"):
        fmt.suffix_ids([tool_msg("r")], [])


class _Stub:
    def __init__(self, chat_template):
        self.chat_template = chat_template


def test_template_choice():
    with_tools = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert select_template(_Stub(with_tools)) == (with_tools, "tokenizer")
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert select_template(_Stub(plain))[1] == "chatml_tools"
    assert select_template(_Stub(None))[1] == "chatml_tools"
    assert select_template(_Stub({"default": plain, "tool_use": with_tools}))[1] == "tokenizer"
    assert select_template(_Stub(with_tools), "chatml_tools")[1] == "chatml_tools"
    with pytest.raises(ValueError, match="unknown chat template 'nope'"):
        select_template(_Stub(None), "nope")


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = messages.append({'role': 'user'}) %}",
    "{{ messages[0].update({'content': 'changed'}) }}",
])
def test_sandbox_refuses_unsafe_access(source):
    with pytest.raises(SecurityError):
        render(source, [{"role": "user", "content": "hi"}])


def test_template_helpers():
    assert render("{{ raise_exception('bad') if messages|length > 1 }}ok", [{}]) == "ok"
    with pytest.raises(TemplateError, match="bad"):
        render("{{ raise_exception('bad') }}", [])
    assert render("{{ {'q': '<a&b>'} | tojson }}", []) == '{"q": "<a&b>"}'  # no HTML escaping
    assert render("{% for m in messages %}{{ m }}{% break %}{% endfor %}", [1, 2]) == "1"
    assert render("{% generation %}{{ messages[0] }}{% endgeneration %}", ["x"]) == "x"


@pytest.mark.slow
def test_smollm2_uses_our_template_and_turns_match_the_full_render():
    from transformers import AutoTokenizer

    from agentrl.models import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    fmt = ChatFormat(tok, TOOLS)
    assert fmt.template_name == "chatml_tools" and fmt.end_of_turn == "<|im_end|>"
    assert fmt.end_of_turn_id == tok.convert_tokens_to_ids("<|im_end|>") and fmt.end_of_turn_id in fmt.eos_token_ids
    ids, messages, inputs = conversation(fmt, three_turns(fmt))
    assert tok.decode(ids) + "\n" == fmt.render(messages)
    assert ids + fmt.encode("\n") == fmt.encode(fmt.render(messages))
    assert inputs[2] == fmt.encode(fmt.render(messages[:-1], add_generation_prompt=True))
