"""The calculator tool: arithmetic by AST walk, and refusal of everything that is not arithmetic."""

import pytest

from environments.gsm8k_math.calculator import MAX_EXPRESSION_CHARS, CalculatorError, calculate, evaluate


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", "7"),
    ("(1 + 2) * 3", "9"),
    ("48 / 2 + 24", "48"),
    ("10 / 4", "2.5"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("7 % 3", "1"),
    ("2 ** 10", "1024"),
    ("2 ^ 10", "1024"),  # "^" is read as a power
    ("3 × 4 ÷ 6", "2"),
    ("-3 + -4", "-7"),
    ("+5", "5"),
    ("2 ** -2", "0.25"),
    ("0.1 + 0.2", "0.3"),
    ("1 / 3", "0.333333333333"),
    ("3.0 * 2", "6"),
    ("sqrt(16)", "4"),
    ("sqrt(2)", "1.41421356237"),
    ("abs(-5)", "5"),
    ("round(2.456, 2)", "2.46"),
    ("round(7.6)", "8"),
    ("min(3, 1, 2)", "1"),
    ("max(1, 2.5)", "2.5"),
    ("floor(2.7) + ceil(2.1)", "5"),
    ("  12  ", "12"),
])
def test_values(expression, value):
    assert calculate(expression) == value


def test_evaluate_returns_numbers():
    assert evaluate("6 * 7") == 42 and isinstance(evaluate("6 * 7"), int)
    assert evaluate("1 / 4") == 0.25


@pytest.mark.parametrize("expression, message", [
    ("__import__('os')", "calling __import__ is not allowed"),
    ("__import__('os').system('ls')", "not allowed"),
    ("().__class__", "attributes are not allowed"),
    ("().__class__.__bases__[0].__subclasses__()", "not allowed"),
    ("open('x')", "calling open is not allowed"),
    ("print(1)", "calling print is not allowed"),
    ("x", "names are not allowed"),
    ("pi * 2", "names are not allowed"),
    ("'a' * 3", "strings are not allowed"),
    ("f'{1}'", "strings are not allowed"),
    ("[1, 2][0]", "not allowed"),
    ("(1, 2)", "commas between numbers"),
    ("1,234 + 5", "write 1234, not 1,234"),
    ("lambda: 1", "lambdas are not allowed"),
    ("[i for i in (1, 2)]", "comprehensions are not allowed"),
    ("{1: 2}", "dicts are not allowed"),
    ("1 if 1 else 2", "conditionals are not allowed"),
    ("1 < 2", "comparisons are not allowed"),
    ("True + 1", "bool values are not allowed"),
    ("1j * 2", "complex values are not allowed"),
    ("sqrt(x=4)", "positional arguments only"),
    ("min(5)", "min() takes 2 to 20 argument(s)"),
    ("import os", "invalid syntax"),
    ("1; 2", "invalid syntax"),
    ("3 +", "invalid syntax"),
    ("", "empty"),
    ("9**9**9", "exponents are limited"),
    ("10 ** 31", "exceeds the limit"),
    ("999999 ** 99", "exceeds the limit"),
    ("10 ** 20 * 10 ** 20", "exceeds the limit"),
    ("1e400", "not a finite number"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("sqrt(-1)", "negative"),
    ("(-8) ** (1 / 3)", "not a real number"),
    ("round(1.5, 100)", "between 0 and 12"),
    ("1" * (MAX_EXPRESSION_CHARS + 1), "longer than"),
])
def test_refusals(expression, message):
    text = calculate(expression)
    assert text.startswith("Error: ") and message in text, text
    with pytest.raises(CalculatorError):
        evaluate(expression)


def test_non_string_is_refused():
    with pytest.raises(CalculatorError):
        evaluate(42)


def test_never_runs_code(tmp_path, monkeypatch):
    # If anything were executed, this would create a file.
    monkeypatch.chdir(tmp_path)
    calculate("open('created', 'w')")
    calculate("__import__('pathlib').Path('created').touch()")
    assert list(tmp_path.iterdir()) == []
