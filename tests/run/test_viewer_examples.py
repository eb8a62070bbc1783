"""The viewer draws the worked examples that open a prompt (assistant and tool turns before the question) apart
from the model's own turns: collapsed under "worked examples", greyed, and never counted as the model's."""

from __future__ import annotations

from html.parser import HTMLParser

from agentrl.view import render, split_messages

SYSTEM = {"role": "system", "content": "Search, then answer."}
SEARCH_A = '<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>'
EXAMPLE_ONE = [{"role": "user", "content": "Example question one?"},
               {"role": "assistant", "content": SEARCH_A},
               {"role": "tool", "name": "search", "content": "[1] A\nA is B."},
               {"role": "assistant", "content": "<answer>B</answer>"}]
EXAMPLE_TWO = [{"role": "user", "content": "Example question two?"},
               {"role": "assistant", "content": "<answer>yes</answer>"}]
QUESTION = {"role": "user", "content": "The real question?"}
OWN = [{"role": "assistant", "content": '<tool_call>{"name": "search", "arguments": {"query": "q"}}</tool_call>'},
       {"role": "tool", "name": "search", "content": "[1] Q\nQ is R."},
       {"role": "assistant", "content": "<answer>R</answer>"}]


def record(messages: list[dict], **extra) -> dict:
    return {"prompt_index": 0, "reward": 1.0, "num_turns": 2, "finish_reason": "done", "gold": "R",
            "messages": messages, "tool_calls": [], **extra}


class Messages(HTMLParser):
    """(classes, inside the examples' <details>, summary text) of every message div."""

    def __init__(self):
        super().__init__()
        self.stack, self.found, self.summaries = [], [], []
        self.in_summary = False

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        self.stack.append((tag, "examples" in classes))
        if tag == "div" and "msg" in classes:
            self.found.append((classes, any(flag for _, flag in self.stack)))
        self.in_summary = tag == "summary" or self.in_summary

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass
        if tag == "summary":
            self.in_summary = False

    def handle_data(self, data):
        if self.in_summary:
            self.summaries.append(data)


def parsed(records: list[dict]) -> Messages:
    parser = Messages()
    parser.feed(render(records))
    return parser


def test_worked_examples_are_collapsed_and_greyed_apart_from_the_model_turns():
    messages = [SYSTEM, *EXAMPLE_ONE, *EXAMPLE_TWO, QUESTION, *OWN]
    page = parsed([record(messages)])
    roles = [([c for c in classes if c not in ("msg", "example")][0], "example" in classes, inside)
             for classes, inside in page.found]
    assert roles == [("system", False, False),
                     ("user", True, True), ("assistant", True, True), ("tool", True, True), ("assistant", True, True),
                     ("user", True, True), ("assistant", True, True),
                     ("user", False, False),
                     ("assistant", False, False), ("tool", False, False), ("assistant", False, False)]
    assert [s.strip() for s in page.summaries] == ["2 worked examples (part of the prompt, not the model's turns)"]
    assert ".examples .msg{opacity:.55" in render([record(messages)])


def test_the_record_count_of_prompt_messages_wins_over_the_last_user_turn():
    # a prompt that ends with an assistant prefill: the record says where the prompt ends
    prefill = {"role": "assistant", "content": "Let me search."}
    parts = split_messages(record([SYSTEM, *EXAMPLE_TWO, QUESTION, prefill, *OWN], num_prompt_messages=5))
    assert parts["head"] == [SYSTEM] and parts["examples"] == [*EXAMPLE_TWO, QUESTION, prefill]
    assert parts["question"] == [] and parts["own"] == OWN and parts["example_count"] == 2
    parts = split_messages(record([SYSTEM, *EXAMPLE_ONE, QUESTION, *OWN]))
    assert parts == {"head": [SYSTEM], "examples": EXAMPLE_ONE, "question": [QUESTION], "own": OWN,
                     "example_count": 1}


def test_no_worked_examples_no_examples_block():
    page = parsed([record([SYSTEM, QUESTION, *OWN]), record([QUESTION, OWN[-1]])])
    assert all(not inside and "example" not in classes for classes, inside in page.found)
    assert len(page.found) == 5 + 2 and "worked example" not in render([record([QUESTION, OWN[-1]])])
    assert "1 worked example (" in render([record([SYSTEM, *EXAMPLE_TWO, QUESTION, *OWN])])
