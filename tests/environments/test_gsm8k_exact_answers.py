"""GSM8K answer comparison is exact: integers and terminating decimals compare as rationals, never within a
tolerance; only a number without a finite decimal expansion accepts a decimal, one with at least
MIN_SIGNIFICANT_DIGITS significant digits that is it rounded to the nearest or truncated at its own last place."""

from decimal import Decimal
from fractions import Fraction

import pytest

from environments.gsm8k_math.answer import MIN_SIGNIFICANT_DIGITS, canonical, is_correct

# (completion, gold, correct?)
EXACT = [
    # integers: equal or not, however large
    ("The answer is 1000001", "#### 1000000", False),
    ("The answer is 1000000", "#### 1000000", True),
    ("<answer>999999</answer>", "#### 1000000", False),
    ("<answer>123456789012345679</answer>", "#### 123456789012345678", False),
    ("<answer>123456789012345678</answer>", "#### 123456789012345678", True),
    ("<answer>1,000,001</answer>", "#### 1,000,000", False),
    ("<answer>100000000000000000001</answer>", "#### 100000000000000000000", False),
    ("<answer>72.0000001</answer>", "#### 72", False),
    ("<answer>71.9999999</answer>", "#### 72", False),
    ("<answer>72.000</answer>", "#### 72", True),
    ("<answer>144/2</answer>", "#### 72", True),
    ("<answer>0</answer>", "#### 0", True),
    ("<answer>-0</answer>", "#### 0", True),
    ("<answer>0.0000001</answer>", "#### 0", False),
    ("<answer>-5</answer>", "#### 5", False),
    # terminating decimals and the fractions equal to them
    ("<answer>0.5</answer>", "#### 0.5", True),
    ("<answer>1/2</answer>", "#### 0.5", True),
    ("<answer>2/4</answer>", "#### 0.5", True),
    ("\\boxed{\\frac{1}{2}}", "#### 0.5", True),
    ("<answer>0.50</answer>", "#### 1/2", True),
    ("<answer>0.5000001</answer>", "#### 0.5", False),
    ("<answer>0.4999999</answer>", "#### 1/2", False),
    ("<answer>$2.75</answer>", "#### 2.75", True),
    ("<answer>2.8</answer>", "#### 2.75", False),
    ("<answer>3</answer>", "#### 2.75", False),
    ("<answer>11/4</answer>", "#### 2.75", True),
    ("<answer>0.125</answer>", "#### 1/8", True),
    ("<answer>0.12</answer>", "#### 1/8", False),
    ("<answer>-1.25</answer>", "#### -5/4", True),
    ("<answer>1.25</answer>", "#### -5/4", False),
    # percentages: "%" is a unit, read as the number before it
    ("<answer>50%</answer>", "#### 50", True),
    ("<answer>50 %</answer>", "#### 50", True),
    ("<answer>12.5%</answer>", "#### 12.5", True),
    ("<answer>0.5</answer>", "#### 50", False),
    ("<answer>50%</answer>", "#### 0.5", False),
    ("<answer>51%</answer>", "#### 50", False),
    # numbers without a finite decimal expansion: the fraction, or a long enough decimal rounding it
    ("<answer>1/3</answer>", "#### 1/3", True),
    ("<answer>2/6</answer>", "#### 1/3", True),
    ("<answer>0.333333</answer>", "#### 1/3", True),  # 6 significant digits, rounded down
    ("<answer>0.3333333</answer>", "#### 1/3", True),
    ("<answer>0.3333334</answer>", "#### 1/3", False),  # neither the nearest nor the truncation
    ("<answer>0.3333332</answer>", "#### 1/3", False),
    ("<answer>0.33333</answer>", "#### 1/3", False),  # 5 significant digits
    ("<answer>0.33</answer>", "#### 1/3", False),
    ("<answer>0.3</answer>", "#### 1/3", False),
    ("<answer>0.666667</answer>", "#### 2/3", True),
    ("<answer>0.666666</answer>", "#### 2/3", True),  # truncated
    ("<answer>0.666668</answer>", "#### 2/3", False),
    ("<answer>0.67</answer>", "#### 2/3", False),
    ("<answer>-0.666667</answer>", "#### -2/3", True),
    ("<answer>0.666667</answer>", "#### -2/3", False),
    ("<answer>333.333</answer>", "#### 1000/3", True),  # significant digits, not decimal places
    ("<answer>333.33</answer>", "#### 1000/3", False),
    ("<answer>333333</answer>", "#### 1000000/3", False),  # an integer is exact, never an approximation
    ("<answer>0.00333333</answer>", "#### 1/300", True),  # leading zeros are not significant
    ("<answer>0.0033333</answer>", "#### 1/300", False),
    ("<answer>0.142857</answer>", "#### 1/7", True),
    ("<answer>0.142858</answer>", "#### 1/7", False),
    ("\\boxed{\\frac{1}{7}}", "#### 1/7", True),
    # the rule is symmetric: a gold written as a long decimal accepts the fraction it rounds
    ("<answer>2/3</answer>", "#### 0.6666667", True),
    ("<answer>2/3</answer>", "#### 0.67", False),
    ("<answer>1/3</answer>", "#### 0.3333", False),
    # ... but two decimals compare exactly, each being a finite number
    ("<answer>0.333333</answer>", "#### 0.3333333", False),
    ("<answer>0.6666667</answer>", "#### 0.6666667", True),
]


@pytest.mark.parametrize("completion, gold, correct", EXACT)
def test_comparison_is_exact(completion, gold, correct):
    assert is_correct(completion, gold) is correct


@pytest.mark.parametrize("n", [1, 7, 10, 99, 1000, 123456, 10**9 + 7, 10**15])
def test_no_integer_is_off_by_one(n):
    assert is_correct(f"#### {n}", f"#### {n}")
    assert not is_correct(f"#### {n + 1}", f"#### {n}") and not is_correct(f"#### {n - 1}", f"#### {n}")


@pytest.mark.parametrize("num, den", [(1, 3), (2, 3), (1, 7), (5, 6), (22, 7), (1, 9), (100, 3), (1, 11), (-2, 3)])
def test_decimals_standing_for_a_repeating_fraction(num, den):
    """At 6 significant digits and beyond (trailing zeros not counted), the value rounded to the nearest and the
    value truncated at the last place both match; any other decimal there does not; below 6 digits none does."""
    value = Fraction(num, den)
    for places in range(1, 10):
        scale = 10 ** places
        truncated, nearest = Fraction(int(value * scale), scale), Fraction(round(value * scale), scale)
        for step in range(-2, 3):
            candidate = truncated + Fraction(step, scale)
            # Written with trailing zeros ("0.09090910"), a decimal is judged at its last non-zero place.
            text = canonical(candidate)
            shown = 10 ** len(text.partition(".")[2])
            long_enough = len(text.replace("-", "").replace(".", "").lstrip("0")) >= MIN_SIGNIFICANT_DIGITS
            expected = long_enough and "." in text and candidate in (Fraction(int(value * shown), shown),
                                                                     Fraction(round(value * shown), shown))
            assert expected or candidate not in (truncated, nearest) or not long_enough
            written = format(Decimal(candidate.numerator) / Decimal(candidate.denominator), f".{places}f")
            assert is_correct(f"<answer>{written}</answer>", f"#### {num}/{den}") is expected, (written, num, den)


def test_canonical_of_a_repeating_fraction_is_the_fraction():
    assert canonical(Fraction(1, 3)) == "1/3" and canonical(Fraction(1, 8)) == "0.125"
