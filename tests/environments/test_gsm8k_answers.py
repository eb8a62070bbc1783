"""GSM8K answer extraction and numeric equivalence over many answer formats."""

import json

import pytest

from environments.gsm8k_math import extract_answer, is_correct
from environments.gsm8k_math.answer import canonical, gold_number

# (completion, canonical extracted answer)
EXTRACTIONS = [
    ("#### 72", "72"),
    ("Natalia sold 48+24 = 72 clips.\n#### 72", "72"),
    ("#### 1,234", "1234"),
    ("####   -7  ", "-7"),
    ("#### $18", "18"),
    ("#### Step 1: add\nthen 3 + 4 = 7", "7"),  # a markdown heading is not the answer marker
    ("#### 5\nWait, I made a mistake.\n#### 6", "6"),  # the last marker wins
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{3}{4}}", "0.75"),
    ("\\boxed{\\dfrac{-3}{4}}", "-0.75"),
    ("\\boxed{1{,}234}", "1234"),
    ("\\boxed{\\frac{1.5}{3}}", "0.5"),
    ("\\boxed{\\frac{1,000}{3}}", "1000/3"),
    ("\\boxed{\\$18.50}", "18.5"),
    ("\\boxed{25\\%}", "25"),
    ("\\boxed{x = 12}", "12"),
    ("\\boxed{ 7 } and \\boxed{9}", "9"),
    ("<answer>17</answer>", "17"),
    ("<answer>$5.00</answer>", "5"),
    ("<answer>€5</answer>", "5"),
    ("<answer>-$5</answer>", "-5"),
    ("<answer> 5 apples </answer>", "5"),
    ("<ANSWER>3/4</ANSWER>", "0.75"),
    ("<answer>2 + 3 = 5</answer>", "5"),
    ("<answer>unknown</answer> but maybe 5", None),  # an explicit non-answer stays one
    ("She has 5 apples and buys 3 more, so 8 apples.", "8"),
    ("The total is $1,234.50.", "1234.5"),
    ("It weighs 5kg.", "5"),
    ("About 50% of them.", "50"),
    ("That is 5.0", "5"),
    ("That is 5.00.", "5"),
    ("The temperature fell to -12 degrees.", "-12"),
    ("10-3=7", "7"),  # the second operand is not a negative number
    ("She ate 1/3 of it.", "1/3"),
    ("Pour .5 cups", "0.5"),
    ("It cost £ 30", "30"),
    ("Version v1.5 has no numbers of note", None),
    ("There is no number here.", None),
    ("", None),
    (None, None),
    ("12,345,678 people", "12345678"),
    ("1, 2, 3", "3"),
]


@pytest.mark.parametrize("text, expected", EXTRACTIONS)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# (completion, gold answer in GSM8K format, correct?)
JUDGEMENTS = [
    ("#### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", True),
    ("<answer>72</answer>", "#### 72", True),
    ("<answer>72.0</answer>", "#### 72", True),
    ("\\boxed{72.00}", "#### 72", True),
    ("<answer>$1,000</answer>", "#### 1000", True),
    ("<answer>1000</answer>", "#### 1,000", True),
    ("<answer>0.75</answer>", "#### 3/4", True),
    ("\\boxed{\\frac{6}{8}}", "#### 0.75", True),
    ("<answer>0.3333333</answer>", "#### 1/3", True),  # within the tolerance
    ("<answer>0.33</answer>", "#### 1/3", False),  # rounded: wrong
    ("<answer>-7</answer>", "#### -7", True),
    ("<answer>7</answer>", "#### -7", False),
    ("<answer>50%</answer>", "#### 50", True),
    ("<answer>0.5</answer>", "#### 50", False),  # a fraction is not a percentage
    ("So she pays 18 dollars.", "#### 18", True),
    ("18 is what she pays, plus 2 tax.", "#### 18", False),  # the last number counts without a marker
    ("<answer>18</answer> and later 20", "#### 18", True),  # ... but a marker beats later numbers
    ("<answer>seventy-two</answer>", "#### 72", False),
    ("", "#### 72", False),
    ("#### 72", "#### banana", False),  # an unparsable gold never matches
    ("<answer>72</answer>", "72", True),  # a bare gold number works too
    ("#### 720", "#### 72", False),
]


@pytest.mark.parametrize("completion, gold, correct", JUDGEMENTS)
def test_is_correct(completion, gold, correct):
    assert is_correct(completion, gold) is correct


@pytest.mark.parametrize("num, den, text", [(6, 3, "2"), (1, 4, "0.25"), (-5, 2, "-2.5"), (1, 3, "1/3"),
                                            (3, 40, "0.075"), (0, 1, "0")])
def test_canonical(num, den, text):
    from fractions import Fraction

    assert canonical(Fraction(num, den)) == text


def test_real_gold_answers_parse_and_self_match(shared_data):
    with (shared_data / "gsm8k" / "train.jsonl").open() as f:
        rows = [json.loads(line) for line in f][:1000]
    assert all(gold_number(r["answer"]) is not None for r in rows)
    assert all(is_correct(r["answer"], r["answer"]) for r in rows)
    # The gold number restated in the styles models use still matches.
    for r in rows[:100]:
        gold = r["answer"].rsplit("####", 1)[1].strip()
        assert is_correct(f"<answer>{gold}</answer>", r["answer"])
        assert is_correct(f"so \\boxed{{{gold}}}", r["answer"])
