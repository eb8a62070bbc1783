"""Environments from anywhere: built-in names, module:Class / module:function, path/to/file.py:Class, entry points
of installed packages; every way a name fails is one ValueError on one line."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

from agentrl.cli import main
from agentrl.env import Environment
from agentrl.env.loading import (ENTRY_POINT_GROUP, available_environments, environment_listings, load_environment,
                                 resolve_environment, run_name)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hotpotqa_with_lookup.py"

TOY = '''
from agentrl import Environment, tool


class Toy(Environment):
    name = "toy"
    greeting: str = "hi"

    @tool
    def add(self, a: int, b: int) -> str:
        """Add two numbers.

        Args:
            a: first.
            b: second.
        """
        return str(a + b)

    def load_dataset(self, split="train", path=None, limit=None):
        return [{"question": "1 + 2?", "answer": "3"}]

    def reward(self, episode):
        return 0.0


class NotAnEnv:
    pass


def make_toy(greeting: str = "hello", **kwargs):
    return Toy(greeting=greeting, **kwargs)


def make_nothing(**kwargs):
    return {"not": "an environment"}


TOY_INSTANCE = Toy()
SETTINGS = {"a": 1}
'''


@pytest.fixture
def isolated_imports():
    """sys.path and sys.modules as they were, after the test: the modules it imported are forgotten."""
    path, modules = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        del sys.modules[name]


@pytest.fixture
def toy_module(tmp_path, isolated_imports):
    """`toy_envs_for_test` importable from a folder on sys.path."""
    (tmp_path / "toy_envs_for_test.py").write_text(TOY)
    sys.path.insert(0, str(tmp_path))
    return tmp_path


def fake_entry_points(monkeypatch, *entries: tuple[str, str]):
    """`importlib.metadata.entry_points` as if installed packages registered `entries` (name, value)."""
    real = importlib.metadata.entry_points
    points = [importlib.metadata.EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in entries]

    def entry_points(**params):
        if params.get("group") == ENTRY_POINT_GROUP:
            return importlib.metadata.EntryPoints(points)
        return real(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


# --------------------------------------------------------------------------------------------------- forms


def test_builtin_names_as_before():
    env = load_environment("gsm8k_math", use_calculator=False)
    assert type(env).__name__ == "GSM8KMathEnv" and env.tool_names() == []
    assert load_environment("hotpotqa-search", few_shot=1).few_shot == 1  # '-' for '_' still works
    found = resolve_environment("hotpotqa_search")
    assert found.origin == "built-in" and found.module.__name__ == "environments.hotpotqa_search"


def test_module_colon_class_is_instantiated_with_the_arguments(toy_module):
    env = load_environment("toy_envs_for_test:Toy", greeting="hey", max_tool_output_chars=9)
    assert type(env).__name__ == "Toy" and env.greeting == "hey" and env.max_tool_output_chars == 9
    assert env.tool_names() == ["add"]
    found = resolve_environment("toy_envs_for_test:Toy")
    assert found.origin == "module toy_envs_for_test" and found.module.__name__ == "toy_envs_for_test"


def test_module_colon_function_is_called_with_the_arguments(toy_module):
    assert load_environment("toy_envs_for_test:make_toy").greeting == "hello"
    assert load_environment("toy_envs_for_test:make_toy", greeting="yo").greeting == "yo"


def test_file_colon_class_loads_the_readme_subclass(monkeypatch, isolated_imports):
    env = load_environment(f"{EXAMPLE}:HotpotQAWithLookup", few_shot=1)
    assert type(env).__name__ == "HotpotQAWithLookup" and env.few_shot == 1
    assert env.tool_names() == ["search", "open_page"]
    # the same file, named again (here relative to the working directory), gives the same class, not a copy
    monkeypatch.chdir(ROOT)
    again = resolve_environment("examples/hotpotqa_with_lookup.py:HotpotQAWithLookup")
    assert again.factory is type(env) and again.origin == "file examples/hotpotqa_with_lookup.py"


def test_file_imports_its_sibling_modules(tmp_path, isolated_imports):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "toy_sibling_helpers.py").write_text(TOY)
    (tmp_path / "pkg" / "my_env.py").write_text("from toy_sibling_helpers import Toy\n\n\nclass Mine(Toy):\n"
                                                "    greeting = 'mine'\n")
    env = load_environment(f"{tmp_path / 'pkg' / 'my_env.py'}:Mine")
    assert env.greeting == "mine" and env.tool_names() == ["add"]


def test_entry_points_of_installed_packages(toy_module, monkeypatch):
    fake_entry_points(monkeypatch, ("toy", "toy_envs_for_test:Toy"), ("toy_made", "toy_envs_for_test:make_toy"),
                      ("gsm8k_math", "toy_envs_for_test:Toy"))
    assert available_environments() == ["gsm8k_math", "hotpotqa_search", "toy", "toy_made"]
    origins = {listing.name: listing.origin for listing in environment_listings()}
    assert origins == {"gsm8k_math": "built-in", "hotpotqa_search": "built-in",
                       "toy": "entry point toy_envs_for_test:Toy", "toy_made": "entry point toy_envs_for_test:make_toy"}
    assert load_environment("toy", greeting="ep").greeting == "ep"
    assert load_environment("toy_made").greeting == "hello"
    assert type(load_environment("gsm8k_math")).__name__ == "GSM8KCalculatorEnv"  # a built-in keeps its name


def test_envs_command_lists_name_origin_and_tools(toy_module, monkeypatch, capsys):
    fake_entry_points(monkeypatch, ("toy", "toy_envs_for_test:Toy"), ("broken", "no_such_module_for_test:Env"))
    assert main(["envs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["gsm8k_math", "built-in"], ["hotpotqa_search", "built-in"],
                                                   ["broken", "entry"], ["toy", "entry"]]
    assert lines[0].split()[2:] == ["tools:", "calculate"] and lines[1].split()[2:] == ["tools:", "search"]
    assert lines[3].split()[1:] == ["entry", "point", "toy_envs_for_test:Toy", "tools:", "add"]
    assert "tools: (does not load: ValueError: " in lines[2] and "no module named 'no_such_module_for_test'" in lines[2]


@pytest.mark.parametrize("name, expected", [
    ("gsm8k_math", "gsm8k_math"),
    ("hotpotqa-search", "hotpotqa-search"),
    ("examples/hotpotqa_with_lookup.py:HotpotQAWithLookup", "hotpotqawithlookup"),
    ("/abs/dir/env.py:My_Env", "my_env"),
    ("my_pkg.envs:make_env", "make_env"),
    ("my_pkg.envs:Outer.Inner", "inner"),
    ("C:\\envs\\mine.py:Mine", "mine"),
    ("odd name!", "odd_name"),
])
def test_run_name_is_a_plain_directory_name(name, expected):
    assert run_name(name) == expected


# --------------------------------------------------------------------------------------------------- errors


def one_line_error(name: str, **kwargs) -> str:
    with pytest.raises(ValueError) as caught:
        load_environment(name, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and message
    return message


def test_unknown_name_lists_what_exists():
    message = one_line_error("gsm8k")
    assert message.startswith("unknown environment 'gsm8k'; available: gsm8k_math, hotpotqa_search")
    assert "did you mean gsm8k_math?" in message and "module:Class or path/to/file.py:Class" in message
    assert one_line_error("../etc/passwd").startswith("unknown environment '../etc/passwd'; available: ")


def test_unknown_name_lists_entry_points_too(monkeypatch):
    fake_entry_points(monkeypatch, ("toy", "toy_envs_for_test:Toy"))
    assert "available: gsm8k_math, hotpotqa_search, toy;" in one_line_error("nope")


def test_missing_module(toy_module):
    message = one_line_error("no_such_module_for_test:Env")
    assert message.startswith("environment 'no_such_module_for_test:Env': no module named 'no_such_module_for_test'")


@pytest.mark.parametrize("body, why", [
    ("import no_such_dependency_for_test\n", "ModuleNotFoundError: No module named 'no_such_dependency_for_test'"),
    ("x = 1\nraise RuntimeError('config missing')\n", "RuntimeError: config missing"),
    ("def broken(:\n    pass\n", "SyntaxError: "),
])
def test_module_that_does_not_import_says_why(tmp_path, isolated_imports, body, why):
    sys.path.insert(0, str(tmp_path))
    (tmp_path / "failing_env_for_test.py").write_text(body)
    message = one_line_error("failing_env_for_test:Env")
    assert message.startswith("environment 'failing_env_for_test:Env': module failing_env_for_test fails to import: ")
    assert why in message
    if not why.startswith("SyntaxError"):  # where it failed: the module's own line
        assert f"failing_env_for_test.py:{body.count(chr(10))})" in message
    from_file = one_line_error(f"{tmp_path / 'failing_env_for_test.py'}:Env")
    assert "failing_env_for_test.py fails to import: " in from_file and why in from_file
    assert not [m for m in sys.modules if m.startswith("agentrl_env_file_failing_env_for_test")]  # no half module


def test_missing_file(tmp_path):
    assert one_line_error(f"{tmp_path}/nope.py:Env") == f"environment '{tmp_path}/nope.py:Env': no such file " \
                                                        f"{tmp_path}/nope.py"
    assert one_line_error(f"{tmp_path}:Env").endswith(f"{tmp_path} is not a file")


def test_missing_attribute_names_what_the_module_defines(toy_module):
    message = one_line_error("toy_envs_for_test:Tyo")
    assert message == "environment 'toy_envs_for_test:Tyo': toy_envs_for_test has no attribute 'Tyo'; it defines Toy"
    assert one_line_error(f"{EXAMPLE}:HotpotQA").endswith("has no attribute 'HotpotQA'; it defines HotpotQAWithLookup")


@pytest.mark.parametrize("attr, fragment", [
    ("NotAnEnv", "NotAnEnv is a class but not an Environment subclass; it defines Toy"),
    ("SETTINGS", "SETTINGS is a dict, not an Environment class or a function that returns one; it defines Toy"),
    ("TOY_INSTANCE", "TOY_INSTANCE is an Environment instance; name its class, or a function that builds one"),
])
def test_attribute_that_is_not_an_environment(toy_module, attr, fragment):
    assert one_line_error(f"toy_envs_for_test:{attr}") == f"environment 'toy_envs_for_test:{attr}': {fragment}"


def test_function_that_returns_something_else(toy_module):
    with pytest.raises(TypeError, match=r"^environment 'toy_envs_for_test:make_nothing': make_nothing returned "
                                        r"dict, not an Environment$"):
        load_environment("toy_envs_for_test:make_nothing")


@pytest.mark.parametrize("name", ["", "toy_envs_for_test:", ":Toy"])
def test_malformed_names(name):
    assert one_line_error(name)


def test_entry_point_to_a_missing_attribute(toy_module, monkeypatch):
    fake_entry_points(monkeypatch, ("toy", "toy_envs_for_test:Gone"))
    assert one_line_error("toy") == "environment 'toy': toy_envs_for_test has no attribute 'Gone'; it defines Toy"


def test_resolved_classes_are_environments(toy_module):
    assert issubclass(resolve_environment("toy_envs_for_test:Toy").factory, Environment)
