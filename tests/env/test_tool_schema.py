"""Tool schemas from type hints and docstrings, and how Environment collects its tools."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, List, Literal, Optional, Sequence, Union

import pytest

from agentrl import Environment, tool
from agentrl.env.schema import function_schema, parse_docstring, type_schema


@pytest.mark.parametrize("hint,expected", [
    (str, {"type": "string"}),
    (int, {"type": "integer"}),
    (float, {"type": "number"}),
    (bool, {"type": "boolean"}),
    (dict, {"type": "object"}),
    (list, {"type": "array"}),
    (Any, {}),
    (list[str], {"type": "array", "items": {"type": "string"}}),
    (List[int], {"type": "array", "items": {"type": "integer"}}),
    (Sequence[float], {"type": "array", "items": {"type": "number"}}),
    (tuple[int, ...], {"type": "array", "items": {"type": "integer"}}),
    (list[list[bool]], {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}}}),
    (dict[str, int], {"type": "object", "additionalProperties": {"type": "integer"}}),
    (Optional[int], {"type": ["integer", "null"]}),
    (str | None, {"type": ["string", "null"]}),
    (Union[int, str], {"type": ["integer", "string"]}),
    (Literal["fast", "slow"], {"type": "string", "enum": ["fast", "slow"]}),
    (Literal[1, 2, 3], {"type": "integer", "enum": [1, 2, 3]}),
    (Literal["a", 1], {"type": ["string", "integer"], "enum": ["a", 1]}),
    (Optional[Literal["a", "b"]], {"type": ["string", "null"], "enum": ["a", "b", None]}),
    (Optional[list[int]], {"type": ["array", "null"], "items": {"type": "integer"}}),
    (Union[list[int], dict], {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "object"}]}),
    (Annotated[int, "ignored here"], {"type": "integer"}),
])
def test_type_hint(hint, expected):
    assert type_schema(hint) == expected


@pytest.mark.parametrize("hint", [bytes, complex, tuple[int, str], Literal[b"x"], set[object]])
def test_unsupported_hint_is_refused(hint):
    with pytest.raises(TypeError):
        type_schema(hint)


def lookup(self, title: str, limit: int = 5, exact: bool = False, mode: Literal["a", "b"] = "a",
           tags: Optional[list[str]] = None, score: float | None = None, episode=None) -> str:
    """Look a page up by title.

    Titles are matched case-insensitively;
    punctuation is ignored.

    Args:
        title (str): the page title,
            as shown in search results.
        limit: how many sentences to return.
        exact: require an exact match.
        mode: which index to read.
        tags: keep only pages with these tags.

    Returns:
        The page text.
    """


def test_full_function_schema():
    assert function_schema(lookup) == {"type": "function", "function": {
        "name": "lookup",
        "description": "Look a page up by title.\n\nTitles are matched case-insensitively; punctuation is ignored.",
        "parameters": {"type": "object", "required": ["title"], "properties": {
            "title": {"type": "string", "description": "the page title, as shown in search results."},
            "limit": {"type": "integer", "description": "how many sentences to return.", "default": 5},
            "exact": {"type": "boolean", "description": "require an exact match.", "default": False},
            "mode": {"type": "string", "enum": ["a", "b"], "description": "which index to read.", "default": "a"},
            "tags": {"type": ["array", "null"], "items": {"type": "string"},
                     "description": "keep only pages with these tags."},
            "score": {"type": ["number", "null"]},
        }},
    }}


def test_optional_without_default_is_required_but_nullable():
    def f(x: Optional[int]):
        """F."""

    params = function_schema(f)["function"]["parameters"]
    assert params["required"] == ["x"] and params["properties"]["x"] == {"type": ["integer", "null"]}


def test_annotated_text_documents_a_parameter_without_docstring_entry():
    def f(q: Annotated[str, "the query"]):
        """F."""

    assert function_schema(f)["function"]["parameters"]["properties"]["q"] == {"type": "string", "description": "the query"}


def test_unannotated_parameter_and_no_docstring():
    def f(x, y=2):
        pass

    fn = function_schema(f)["function"]
    assert fn["description"] == ""
    assert fn["parameters"] == {"type": "object", "properties": {"x": {}, "y": {"default": 2}}, "required": ["x"]}


def test_variadic_parameters_are_refused():
    def f(*words: str):
        """F."""

    with pytest.raises(TypeError, match="args"):
        function_schema(f)


def test_docstring_sections_other_than_args_are_dropped():
    desc, args = parse_docstring("Sum two numbers.\n\nArgs:\n    a: first.\n    b: second\n        continued.\n"
                                 "Raises:\n    ValueError: never.\nExample:\n    x: not an arg\n")
    assert desc == "Sum two numbers." and args == {"a": "first.", "b": "second continued."}


class Base(Environment):
    name = "base"

    @tool
    def first(self, q: str) -> str:
        """First tool."""
        return "1" + q

    def helper(self) -> str:
        return "not a tool"

    @tool(timeout=1.5, name="second_tool", description="Custom text.")
    async def second(self, n: int, episode) -> str:
        """Ignored docstring."""
        episode.state["n"] = n
        return str(n)


class Child(Base):
    @tool
    def third(self) -> str:
        """Third tool."""
        return "3"

    @tool
    def first(self, q: str, loud: bool = False) -> str:
        """First tool, overridden."""
        return ("1" + q).upper() if loud else "1" + q


class Pruned(Child):
    def third(self) -> str:  # overridden without @tool: no longer offered to the model
        return "plain"


def names(env):
    return [t["function"]["name"] for t in env.tools()]


def test_tools_in_definition_order_with_inheritance():
    assert names(Base()) == ["first", "second_tool"]
    assert names(Child()) == ["first", "second_tool", "third"]  # an override keeps its ancestor's place
    assert names(Pruned()) == ["first", "second_tool"]
    child = Child().tools()
    assert child[0]["function"]["description"] == "First tool, overridden."
    assert "loud" in child[0]["function"]["parameters"]["properties"]


def test_decorator_options_and_episode_hidden():
    env = Base()
    second = env.tools()[1]["function"]
    assert second["description"] == "Custom text."
    assert second["parameters"] == {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    handle = env.tool_handle("second_tool")
    assert handle.timeout == 1.5 and handle.wants_episode and handle.is_async
    assert env.tool_handle("first").timeout == Environment.tool_timeout_s


def test_tools_stay_directly_callable():
    env = Child()
    assert env.first("x", loud=True) == "1X"
    episode = env.start({"question": "q"})
    assert asyncio.run(env.second(4, episode)) == "4" and episode.state == {"n": 4}


def test_duplicate_tool_names_are_refused():
    class Clash(Environment):
        @tool(name="same")
        def a(self) -> str:
            """A."""

        @tool(name="same")
        def b(self) -> str:
            """B."""

    with pytest.raises(TypeError, match="same"):
        Clash().tools()


def test_environment_without_tools():
    assert Environment().tools() == []


def test_hints_the_model_never_sees_need_not_exist_at_runtime():
    def f(self, q: "list[str]", episode: "NotImportedAtRuntime") -> "AlsoMissing":  # noqa: F821
        """F."""

    assert function_schema(f)["function"]["parameters"]["properties"] == {"q": {"type": "array", "items": {"type": "string"}}}

    def g(q: "Missing"):  # noqa: F821
        """G."""

    with pytest.raises(TypeError, match="cannot resolve type hints"):
        function_schema(g)
