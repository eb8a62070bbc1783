"""parse_tool_calls on well-formed and malformed turns: each form's exact outcome, and it never raises."""

import pytest

from agentrl.chat import parse_tool_calls


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def err(message, raw):
    return {"error": message, "raw": raw}


CASES = [
    # --- well-formed and tolerated forms ---
    ("plain", '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>', [call("search", query="x")]),
    ("no block", "The answer is 4.", []),
    ("newlines inside", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>', [call("a")]),
    ("text around", 'Let me look.\n<tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call>\nok',
     [call("a", k=1)]),
    ("two blocks", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
                   '{"x": [1, 2]}}</tool_call>', [call("a"), call("b", x=[1, 2])]),
    ("trailing commas", '<tool_call>{"name": "a", "arguments": {"x": 1,},}</tool_call>', [call("a", x=1)]),
    ("arguments as JSON string", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', [call("a", x=1)]),
    ("arguments empty string", '<tool_call>{"name": "a", "arguments": ""}</tool_call>', [call("a")]),
    ("arguments null", '<tool_call>{"name": "a", "arguments": null}</tool_call>', [call("a")]),
    ("arguments missing", '<tool_call>{"name": "a"}</tool_call>', [call("a")]),
    ("parameters instead of arguments", '<tool_call>{"name": "a", "parameters": {"q": "z"}}</tool_call>',
     [call("a", q="z")]),
    ("json code fence", '<tool_call>\n```json\n{"name": "a", "arguments": {}}\n```\n</tool_call>', [call("a")]),
    ("bare code fence", '<tool_call>```\n{"name": "a", "arguments": {}}\n```</tool_call>', [call("a")]),
    ("extra keys ignored", '<tool_call>{"name": "a", "arguments": {}, "id": "c1"}</tool_call>', [call("a")]),
    ("name padded", '<tool_call>{"name": " a ", "arguments": {}}</tool_call>', [call("a")]),
    ("unclosed final block", '<tool_call>{"name": "a", "arguments": {"x": 2}}', [call("a", x=2)]),
    ("unclosed block then another", '<tool_call>{"name": "a"}\n<tool_call>{"name": "b"}</tool_call>',
     [call("a"), call("b")]),
    ("stray closing tags", '</tool_call>hm<tool_call>{"name": "a"}</tool_call></tool_call>', [call("a")]),
    ("calls drafted while thinking", '<think>maybe <tool_call>{"name": "x"}</tool_call></think>\n'
                                     '<tool_call>{"name": "y"}</tool_call>', [call("y")]),
    ("only a drafted call", '<think><tool_call>{"name": "x"}</tool_call></think>The answer is 3.', []),
    # SmolLM2's function-calling form: the call wrapped in a one-element JSON list.
    ("one-element list", '<tool_call>[{"name": "search", "arguments": {"query": "x"}}]</tool_call>',
     [call("search", query="x")]),
    ("one-element list over lines", '<tool_call>[\n{"name": "a", "arguments": {"k": 1}}\n]</tool_call>', [call("a", k=1)]),
    ("one-element list, trailing comma", '<tool_call>[{"name": "a"},]</tool_call>', [call("a")]),
    ("one-element list in a fence", '<tool_call>```json\n[{"name": "a"}]\n```</tool_call>', [call("a")]),
    # --- malformed: each becomes an error entry the model will be shown ---
    ("missing brace", '<tool_call>{"name": "search", "arguments": {"query": "x"}</tool_call>',
     [err("invalid JSON: Expecting ',' delimiter (line 1, column 47)", '{"name": "search", "arguments": {"query": "x"}')]),
    ("cut off mid-JSON", '<tool_call>{"name": "a", "argu',
     [err("invalid JSON: Unterminated string starting at (line 1, column 15)", '{"name": "a", "argu')]),
    ("extra closing brace", '<tool_call>{"name": "a", "arguments": {}}}</tool_call>',
     [err("invalid JSON: Extra data (line 1, column 31)", '{"name": "a", "arguments": {}}}')]),
    ("text after the object", '<tool_call>{"name": "a"} thanks</tool_call>',
     [err("invalid JSON: Extra data (line 1, column 15)", '{"name": "a"} thanks')]),
    ("python quotes", "<tool_call>{'name': 'a'}</tool_call>",
     [err("invalid JSON: Expecting property name enclosed in double quotes (line 1, column 2)", "{'name': 'a'}")]),
    ("function-call syntax", '<tool_call>search(query="x")</tool_call>',
     [err("invalid JSON: Expecting value (line 1, column 1)", 'search(query="x")')]),
    ("empty block", "<tool_call></tool_call>", [err("empty tool call", "")]),
    ("whitespace block", "<tool_call>\n  \n</tool_call>", [err("empty tool call", "")]),
    ("empty fence", "<tool_call>```json\n```</tool_call>", [err("empty tool call", "```json\n```")]),
    ("doubled opening tag", '<tool_call><tool_call>{"name": "a"}</tool_call>',
     [err("empty tool call", ""), call("a")]),
    ("empty list", "<tool_call>[]</tool_call>", [err("an empty list is not a tool call", "[]")]),
    ("list of two calls", '<tool_call>[{"name": "a"}, {"name": "b"}]</tool_call>',
     [err("a list of 2 tool calls; write one <tool_call> block per call", '[{"name": "a"}, {"name": "b"}]')]),
    ("list holding a string", '<tool_call>["search"]</tool_call>',
     [err("a tool call must be a JSON object, got array", '["search"]')]),
    ("list holding a list", '<tool_call>[[{"name": "a"}]]</tool_call>',
     [err("a tool call must be a JSON object, got array", '[[{"name": "a"}]]')]),
    ("list of a call and a number", '<tool_call>[{"name": "a"}, 1]</tool_call>',
     [err("a tool call must be a JSON object, got array", '[{"name": "a"}, 1]')]),
    ("list holding a call without a name", '<tool_call>[{"arguments": {}}]</tool_call>',
     [err('missing "name"', '[{"arguments": {}}]')]),
    ("list holding bad arguments", '<tool_call>[{"name": "a", "arguments": [1]}]</tool_call>',
     [err('"arguments" must be a JSON object, got array', '[{"name": "a", "arguments": [1]}]')]),
    ("unclosed list", '<tool_call>[{"name": "a"}</tool_call>',
     [err("invalid JSON: Expecting ',' delimiter (line 1, column 15)", '[{"name": "a"}')]),
    ("bare string", '<tool_call>"search"</tool_call>', [err("a tool call must be a JSON object, got string", '"search"')]),
    ("missing name", '<tool_call>{"arguments": {"q": 1}}</tool_call>', [err('missing "name"', '{"arguments": {"q": 1}}')]),
    ("name not a string", '<tool_call>{"name": 3}</tool_call>', [err('"name" must be a string, got number', '{"name": 3}')]),
    ("name null", '<tool_call>{"name": null}</tool_call>', [err('"name" must be a string, got null', '{"name": null}')]),
    ("name empty", '<tool_call>{"name": "  "}</tool_call>', [err('"name" is empty', '{"name": "  "}')]),
    ("arguments an array", '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
     [err('"arguments" must be a JSON object, got array', '{"name": "a", "arguments": [1]}')]),
    ("arguments a number", '<tool_call>{"name": "a", "arguments": 5}</tool_call>',
     [err('"arguments" must be a JSON object, got number', '{"name": "a", "arguments": 5}')]),
    ("arguments string not JSON", '<tool_call>{"name": "a", "arguments": "x=1"}</tool_call>',
     [err('"arguments" is a string that is not valid JSON: Expecting value (line 1, column 1)',
          '{"name": "a", "arguments": "x=1"}')]),
    ("arguments string of an array", '<tool_call>{"name": "a", "arguments": "[1]"}</tool_call>',
     [err('"arguments" must be a JSON object, got array', '{"name": "a", "arguments": "[1]"}')]),
    ("both arguments and parameters", '<tool_call>{"name": "a", "arguments": {}, "parameters": {}}</tool_call>',
     [err('both "arguments" and "parameters" given; use "arguments"', '{"name": "a", "arguments": {}, "parameters": {}}')]),
    # The block ends at the first closing tag, even inside a JSON string: the tag is a special token to the
    # model, so writing it inside an argument is itself the mistake.
    ("closing tag inside a string", '<tool_call>{"name": "e", "arguments": {"t": "</tool_call>"}}</tool_call>',
     [err("invalid JSON: Unterminated string starting at (line 1, column 34)", '{"name": "e", "arguments": {"t": "')]),
    ("good and bad mixed", '<tool_call>{"name": "a"}</tool_call><tool_call>{oops}</tool_call>',
     [call("a"), err("invalid JSON: Expecting property name enclosed in double quotes (line 1, column 2)", "{oops}")]),
]


@pytest.mark.parametrize("text,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_outcome(text, expected):
    assert parse_tool_calls(text) == expected


def test_enough_malformed_forms_are_covered():
    assert sum(1 for _, _, out in CASES if any("error" in e for e in out)) >= 20


@pytest.mark.parametrize("value", [None, 42, b"<tool_call>", ["<tool_call>"]])
def test_non_text_input_gives_no_calls(value):
    assert parse_tool_calls(value) == []


def test_pathological_nesting_is_an_error_not_a_crash():
    out = parse_tool_calls("<tool_call>" + "[" * 100_000 + "</tool_call>")
    assert len(out) == 1 and out[0]["error"] == "invalid JSON: nested too deeply"


def test_unclosed_block_after_eos_is_stripped_by_decoding_not_parsing():
    # The driver decodes without the final eos; with it left in, the block's JSON is not valid.
    out = parse_tool_calls('<tool_call>{"name": "a"}<|im_end|>')
    assert out == [err("invalid JSON: Extra data (line 1, column 14)", '{"name": "a"}<|im_end|>')]
