"""Final-answer extraction and numeric comparison for grade-school math.

Models write answers in many shapes ("#### 1,234", "\\boxed{\\frac{3}{4}}", "<answer>$5.00</answer>",
"... so she has 18 apples."). Extraction looks for an explicit marker first, in the order GSM8K's own
`#### n`, then `\\boxed{}`, then `<answer>`; without one it takes the last number in the text. The result is
a canonical number string, so "5", "5.0" and "$5.00" all read "5".

Comparison is exact arithmetic on rationals, never a tolerance: "0.5", "1/2", "\\frac{2}{4}" and "0.50" are one
number, and 1000001 is not 1000000. A "%" is a unit, read as the number before it ("50%" is 50, as GSM8K writes a
percent answer), never as a fraction of 100. The one inexact case: a number with no finite decimal expansion
(2/3) cannot be written as a decimal, so a decimal of at least `MIN_SIGNIFICANT_DIGITS` significant digits (trailing
zeros not counted) that is that number rounded to the nearest, or truncated, at its own last place stands for it
(0.666667 and 0.666666 for 2/3, but not 0.67 nor 0.666668); the rule is symmetric, so a gold 0.6666667 accepts 2/3.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

__all__ = ["extract_answer", "extract_marked", "parse_number", "canonical", "gold_number", "is_correct"]

# Significant digits a decimal needs to stand for a number without a finite decimal expansion: as many as a
# calculator shows at the least; "0.33" for 1/3 is a rounded answer, not the answer.
MIN_SIGNIFICANT_DIGITS = 6

_CURRENCY = "$€£¥₹"
# One number: a fraction, a comma-grouped integer (1,234,567.5), a plain or decimal number, or ".5".
# The look-behind keeps digits glued to letters ("x2", "v1.5") and the second half of "10-3" from
# reading as negative numbers.
_NUMBER = re.compile(
    r"(?<![\w.])(-?)"
    r"(\d+\s*/\s*\d+(?![\d.,/])"
    r"|\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])"
    r"|\d+(?:\.\d+)?"
    r"|\.\d+)"
)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.,]+)\s*\}\s*\{\s*(-?[\d.,]+)\s*\}")
# GSM8K's marker is "#### <number>"; "####" followed by words is a markdown heading ("#### Step 1").
_HASHES = re.compile(r"####[ \t]*([-\u2212$€£¥₹\\.\d][^\n]*)")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _clean(text: str) -> str:
    """Undo the typography that hides numbers: LaTeX spacing and escapes, unicode minus, currency."""
    text = text.replace("{,}", ",").replace("\\,", "").replace("\\!", "").replace("\u2009", "").replace("\u202f", "")
    text = text.replace("\\$", "$").replace("\\%", "%").replace("\u2212", "-")
    text = text.replace("\\left", "").replace("\\right", "")
    text = _LATEX_FRAC.sub(_frac_value, text)
    # "-$5" and "$ 5" are the numbers -5 and 5: drop the currency sign (and a space after it).
    text = re.sub(rf"(-?)\s*[{_CURRENCY}]\s*", r" \1", text)
    return text


def _frac_value(match: re.Match) -> str:
    # \frac{1.5}{3} or \frac{1,000}{4} are not plain p/q text, so the value is written out instead.
    try:
        num, den = (Fraction(Decimal(g.replace(",", ""))) for g in match.groups())
    except (InvalidOperation, ValueError):
        return match.group(0)
    return canonical(num / den) if den else match.group(0)


def _numbers(text: str) -> list[Fraction]:
    out = []
    for sign, body in _NUMBER.findall(_clean(text)):
        try:
            if "/" in body:
                num, den = (int(part) for part in body.replace(" ", "").split("/"))
                if den == 0:
                    continue
                value = Fraction(num, den)
            else:
                value = Fraction(Decimal(body.replace(",", "")))
        except (InvalidOperation, ValueError):
            continue
        out.append(-value if sign else value)
    return out


def parse_number(text: str) -> Fraction | None:
    """The number in a short answer span: the last one after any "=", else the first one."""
    if "=" in text:
        text = text.rsplit("=", 1)[1]
    found = _numbers(text)
    return found[0] if found else None


def canonical(value: Fraction) -> str:
    """Integers as integers, terminating decimals without trailing zeros, anything else as p/q."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    text = format(Decimal(value.numerator) / Decimal(value.denominator), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _boxed_spans(text: str) -> list[str]:
    # Balanced braces by hand: \boxed{\frac{3}{4}} nests, which no regex here can follow.
    spans = []
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            spans.append(text[m.end() : i - 1])
    return spans


def extract_marked(text: str) -> tuple[str | None, bool]:
    """(canonical answer or None, whether an explicit answer marker was used)."""
    # The last "#### <number>" wins: a model may restate its answer after correcting itself.
    for span in reversed(_HASHES.findall(text)):
        value = parse_number(span)
        if value is not None:
            return canonical(value), True
    for spans in (_boxed_spans(text), _ANSWER_TAG.findall(text)):
        if spans:
            # A marked answer without a number is a non-answer, not a cue to go hunting in the text.
            value = parse_number(spans[-1])
            return (canonical(value) if value is not None else None), True
    return None, False


def extract_answer(text: str | None) -> str | None:
    """The final answer of a completion as a canonical number string, or None if there is none."""
    if not text:
        return None
    marked, has_marker = extract_marked(text)
    if has_marker:
        return marked
    found = _numbers(text)
    return canonical(found[-1]) if found else None


def gold_number(gold_answer: str) -> Fraction | None:
    """The number of a GSM8K gold answer ("... #### 72"), or of a bare answer ("72")."""
    text = str(gold_answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return parse_number(text)


def is_correct(completion: str | None, gold_answer: str) -> bool:
    """Whether the completion's final answer equals the gold answer (exactly; see the module docstring)."""
    predicted = extract_answer(completion)
    gold = gold_number(gold_answer)
    if predicted is None or gold is None:
        return False
    value = parse_number(predicted)
    if value is None:
        return False
    return value == gold or _rounds_to(predicted, gold) or _rounds_to(canonical(gold), value)


def _rounds_to(decimal_text: str, exact: Fraction) -> bool:
    """Whether `decimal_text` (a canonical decimal such as "0.6666667") is `exact` rounded to the nearest or
    truncated at its last place, where `exact` has no finite decimal expansion (so no rounding tie) and the
    decimal carries enough significant digits."""
    if "." not in decimal_text or "/" not in canonical(exact):
        return False
    places = len(decimal_text.split(".", 1)[1])
    significant = len(decimal_text.replace("-", "").replace(".", "").lstrip("0"))
    if significant < MIN_SIGNIFICANT_DIGITS:
        return False
    scale = 10 ** places
    value = Fraction(Decimal(decimal_text))
    return value in (Fraction(int(exact * scale), scale), Fraction(round(exact * scale), scale))  # int(): toward 0
