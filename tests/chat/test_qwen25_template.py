"""A model's own chat template: Qwen2.5's (the text every Qwen2.5 tokenizer and GGUF carries, stored beside this
file) is chosen over ours because it renders tools, the parser reads exactly the calls it teaches, and turns
appended token for token (tool results grouped in one user turn) equal a render of the whole conversation, through
ChatFormat alone and through the rollout driver."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from agentrl.chat import ChatFormat, parse_tool_calls
from agentrl.tokenizer import byte_tokenizer
from tests.chat.test_chat_template import PROMPT, TOOLS

QWEN25 = (Path(__file__).parent / "qwen2.5_chat_template.jinja").read_text()
IM_END = 258


def qwen_tokenizer():
    """The offline byte tokenizer carrying Qwen2.5's template, as a tokenizer loaded from a Qwen2.5 model does."""
    tok = copy.deepcopy(byte_tokenizer())  # the cached one is shared by every test
    tok.chat_template = QWEN25
    return tok


def call_text(name: str, arguments: dict) -> str:
    """A call in the form the template renders one (and instructs the model to write)."""
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments, ensure_ascii=False) + \
        "}\n</tool_call>"


def structured(messages: list[dict]) -> list[dict]:
    """`messages` with each assistant turn that is a bare call written as `tool_calls`, as an API client sends."""
    out = []
    for m in messages:
        calls = parse_tool_calls(m["content"]) if m["role"] == "assistant" else []
        if calls and m["content"].startswith("<tool_call>") and m["content"].endswith("</tool_call>"):
            m = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c} for c in calls]}
        out.append(m)
    return out


def test_the_models_own_template_is_chosen_because_it_renders_tools():
    fmt = ChatFormat(qwen_tokenizer(), TOOLS)
    assert fmt.template_name == "tokenizer" and fmt.source == QWEN25
    assert fmt.end_of_turn == "<|im_end|>" and fmt.end_of_turn_id == IM_END and IM_END in fmt.eos_token_ids
    assert fmt.stop_strings == ["</tool_call>"]
    text = fmt.render(PROMPT, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nAnswer briefly.\n\n# Tools\n\nYou may call one or more functions")
    assert '\n<tools>\n{"type": "function", "function": {"name": "search"' in text
    assert text.endswith("<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_the_parser_reads_the_form_the_template_teaches():
    text = ChatFormat(qwen_tokenizer(), TOOLS).render(PROMPT)
    taught = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    assert taught in text  # the instruction, verbatim
    answer = call_text("search", {"query": "capital of France", "k": 2})
    assert parse_tool_calls(answer) == [{"name": "search", "arguments": {"query": "capital of France", "k": 2}}]
    # The template's own rendering of a structured call is that same text, and several calls parse in order.
    two = [{"name": "search", "arguments": {"query": "Paris"}}, {"name": "search", "arguments": {"query": "Lyon é"}}]
    fmt = ChatFormat(qwen_tokenizer(), TOOLS)
    rendered = fmt.render([{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "", "tool_calls": [{"function": c} for c in two]}])
    body = rendered.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    assert body == call_text(**two[0]) + "\n" + call_text(**two[1])
    assert parse_tool_calls(body) == two


def test_turns_appended_token_for_token_equal_the_whole_render():
    fmt = ChatFormat(qwen_tokenizer(), TOOLS)
    first = call_text("search", {"query": "France capital"})
    second = call_text("search", {"query": "Paris population"})
    turns = [
        (fmt.encode(first) + [IM_END], [{"role": "tool", "name": "search", "content": "Paris is the capital."}]),
        (fmt.encode(second), [{"role": "tool", "name": "search", "content": "1. about 2.1 million"},  # stopped on
                              {"role": "tool", "name": "search", "content": "2. none"}]),          # </tool_call>
        (fmt.encode("<answer>Paris</answer>") + [IM_END], None),
    ]
    ids, messages = fmt.prompt_ids(PROMPT), list(PROMPT)
    for generated, tool_messages in turns:
        assert ids == fmt.encode(fmt.render(messages, add_generation_prompt=True))
        ids = ids + generated
        messages.append({"role": "assistant", "content": fmt.decode(generated)})
        if tool_messages:
            ids = ids + fmt.suffix_ids(tool_messages, generated)
            messages.extend(tool_messages)
    whole = fmt.render(messages)
    assert fmt.decode(ids, strip_eos=False) + "\n" == whole
    assert ids + fmt.encode("\n") == fmt.encode(whole)
    # Consecutive tool results share one user turn, as the template groups them.
    assert "<|im_start|>user\n<tool_response>\n1. about 2.1 million\n</tool_response>\n<tool_response>\n2. none\n" \
           "</tool_response><|im_end|>\n" in whole
    # ... and the model's text turns render exactly as the same calls sent as structured tool_calls.
    assert fmt.render(structured(messages)) == whole


def test_a_rollout_with_the_template_calls_a_tool_and_its_ids_equal_the_whole_render():
    from agentrl.engine import Engine, EngineConfig
    from agentrl.models import load_model
    from agentrl.rollout import PromptIterator, RolloutConfig, RolloutDriver
    from environments.hotpotqa_search import HotpotQASearchEnv
    from tests.helpers import ScriptedPolicy

    env = HotpotQASearchEnv(top_k=1, max_paragraph_chars=60, system_prompt="Search, then answer in <answer>.",
                            few_shot=0, format_bonus=0)
    samples = env.load_dataset(split="train", limit=2)

    def script(question: str, turn: int) -> str:
        return call_text("search", {"query": question.split()[-1].strip("?")}) if turn == 0 else "<answer>x</answer>"

    model, _ = load_model("tiny-qwen3")
    fmt = ChatFormat(qwen_tokenizer(), env.tools())
    assert fmt.template_name == "tokenizer"
    engine = Engine(ScriptedPolicy(model, script), EngineConfig(num_pages=512, page_size=16,
                                                                eos_token_ids=tuple(fmt.eos_token_ids)))
    prompts = PromptIterator(samples, shuffle=False, max_epochs=1)
    config = RolloutConfig(group_size=1, rollouts_in_flight=2, temperature=0.0, max_turns=3, max_new_tokens=96)
    groups = RolloutDriver(env, engine, fmt, prompts, config).run(on_group=lambda g: prompts.consumed(g.prompt))
    trajectories = [t for g in groups for t in g.trajectories]
    assert len(trajectories) == 2
    for t in trajectories:
        question = next(m["content"] for m in t.messages if m["role"] == "user")
        assert t.num_turns == 2 and [(c.name, c.status) for c in t.tool_calls] == [("search", "ok")]
        assert t.tool_calls[0].arguments == {"query": question.split()[-1].strip("?")}
        assert [m["role"] for m in t.messages[-3:]] == ["assistant", "tool", "assistant"]
        whole = fmt.render(t.messages)
        assert "<|im_start|>user\n<tool_response>\n" + t.messages[-2]["content"] + "\n</tool_response><|im_end|>" \
               in whole
        assert t.input_ids + fmt.encode("\n") == fmt.encode(whole)
        assert fmt.render(structured(t.messages)) == whole
