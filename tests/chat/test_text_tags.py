"""`model.tool_tags=text`: the tool tags a template writes are spelled as ordinary text pieces, not the tokenizer's
added tokens; the text, the parser's reading of calls and the token-for-token turns are unchanged."""

from __future__ import annotations

from agentrl.chat import ChatFormat, parse_tool_calls
from agentrl.chat.template import TOOL_TAGS
from agentrl.env import Environment
from agentrl.run.build import chat_format
from agentrl.train.config import ModelConfig
from tests.chat.test_chat_template import PROMPT, TOOLS
from tests.chat.test_qwen25_template import IM_END, call_text, qwen_tokenizer


def tag_ids(tok) -> set[int]:
    return {tok.convert_tokens_to_ids(tag) for tag in TOOL_TAGS}


def test_prompts_spell_the_tags_as_text_and_render_the_same_text():
    tok = qwen_tokenizer()
    tokens, text = ChatFormat(tok, TOOLS), ChatFormat(tok, TOOLS, text_tags=TOOL_TAGS)
    as_tokens, as_text = tokens.prompt_ids(PROMPT), text.prompt_ids(PROMPT)
    assert tag_ids(tok) & set(as_tokens)  # the template teaches the call's tags
    assert not tag_ids(tok) & set(as_text)
    assert tok.decode(as_text) == tok.decode(as_tokens)
    assert text.encode("<tool_call>") == list("<tool_call>".encode())  # the byte tokenizer's pieces: its bytes
    assert text.stop_sequences == [list(b"</tool_call>")]
    assert tokens.stop_sequences == [[tok.convert_tokens_to_ids("</tool_call>")]]


def test_a_call_written_in_text_pieces_is_read_and_turns_append_token_for_token():
    fmt = ChatFormat(qwen_tokenizer(), TOOLS, text_tags=TOOL_TAGS)
    generated = fmt.encode(call_text("search", {"query": "France capital"})) + [IM_END]
    assert parse_tool_calls(fmt.decode(generated)) == [{"name": "search", "arguments": {"query": "France capital"}}]
    tool = [{"role": "tool", "name": "search", "content": "Paris is the capital."}]
    ids = fmt.prompt_ids(PROMPT) + generated + fmt.suffix_ids(tool, generated)
    messages = [*PROMPT, {"role": "assistant", "content": fmt.decode(generated)}, *tool]
    assert ids == fmt.encode(fmt.render(messages, add_generation_prompt=True))
    assert not tag_ids(fmt.tokenizer) & set(ids)


def test_the_model_section_chooses_the_spelling():
    class Search(Environment):
        pass

    env = Search()
    env.tools = lambda: TOOLS
    tok = qwen_tokenizer()
    assert chat_format(tok, env, ModelConfig()).prompt_ids(PROMPT) == ChatFormat(tok, TOOLS).prompt_ids(PROMPT)
    assert chat_format(tok, env, ModelConfig(tool_tags="text")).prompt_ids(PROMPT) == \
        ChatFormat(tok, TOOLS, text_tags=TOOL_TAGS).prompt_ids(PROMPT)
