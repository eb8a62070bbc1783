"""Built-in grade-school word problems, generated from templates with computed answers.

They let the environment and its tests run with no download. Each template draws its numbers so that every
intermediate result is a whole number, and writes a worked solution in GSM8K's own format (calculator
annotations `<<expr=value>>` and a final `#### n`), so the gold answers go through exactly the same parsing
as real GSM8K data.
"""

from __future__ import annotations

import random
from typing import Callable

__all__ = ["generate_problems", "TEMPLATES"]

_NAMES = ("Mia", "Omar", "Lena", "Ravi", "Sofia", "Tariq", "Hana", "Jonas", "Amara", "Diego", "Yuki", "Priya",
          "Felix", "Noor", "Ines", "Kofi", "Elena", "Mateo", "Zara", "Lukas")
_ITEMS = ("pencil", "notebook", "apple", "sticker", "cupcake", "marble", "ticket", "plant", "book", "candle")
_MONTHS = ("March", "April", "May", "June", "July", "August")


def _calc(expr: str, value: int) -> str:
    return f"<<{expr}={value}>>{value}"


def _change(rng: random.Random, name: str):
    item, n, price = rng.choice(_ITEMS), rng.randint(2, 9), rng.randint(2, 12)
    cost = n * price
    bill = next(b for b in (20, 50, 100, 200) if b > cost)
    return (f"{name} buys {n} {item}s at ${price} each and pays with a ${bill} bill. "
            f"How much change does {name} get, in dollars?",
            [f"The {item}s cost {n}*{price} = ${_calc(f'{n}*{price}', cost)}.",
             f"The change is {bill}-{cost} = ${_calc(f'{bill}-{cost}', bill - cost)}."], bill - cost)


def _half_as_many(rng: random.Random, name: str):
    item, first = rng.choice(_ITEMS), rng.randint(6, 60) * 2
    m1, m2 = rng.sample(_MONTHS, 2)
    half = first // 2
    return (f"{name} sold {first} {item}s in {m1}, and then sold half as many {item}s in {m2}. "
            f"How many {item}s did {name} sell in {m1} and {m2} altogether?",
            [f"In {m2}, {name} sold {first}/2 = {_calc(f'{first}/2', half)} {item}s.",
             f"Altogether {first}+{half} = {_calc(f'{first}+{half}', first + half)} {item}s."], first + half)


def _wages(rng: random.Random, name: str):
    rate, hours, days = rng.randint(8, 30), rng.randint(2, 8), rng.randint(3, 6)
    daily = rate * hours
    return (f"{name} earns ${rate} an hour and works {hours} hours a day for {days} days. "
            f"How many dollars does {name} earn in total?",
            [f"Each day {name} earns {rate}*{hours} = ${_calc(f'{rate}*{hours}', daily)}.",
             f"Over {days} days that is {daily}*{days} = ${_calc(f'{daily}*{days}', daily * days)}."], daily * days)


def _sharing(rng: random.Random, name: str):
    item, friends, each = rng.choice(_ITEMS), rng.randint(2, 8), rng.randint(2, 9)
    given = friends * each
    start = given + rng.randint(1, 40)
    return (f"{name} has {start} {item}s and gives {each} {item}s to each of {friends} friends. "
            f"How many {item}s does {name} have left?",
            [f"{name} gives away {each}*{friends} = {_calc(f'{each}*{friends}', given)} {item}s.",
             f"{name} has {start}-{given} = {_calc(f'{start}-{given}', start - given)} {item}s left."], start - given)


def _discount(rng: random.Random, name: str):
    pct = rng.choice((10, 20, 25, 40, 50, 75))
    price = rng.randint(2, 30) * 20  # a multiple of 20 makes every listed percentage a whole number of dollars
    off = price * pct // 100
    return (f"A bicycle costs ${price}. {name} buys it during a sale at {pct}% off. How many dollars does {name} pay?",
            [f"The discount is {price}*{pct}/100 = ${_calc(f'{price}*{pct}/100', off)}.",
             f"{name} pays {price}-{off} = ${_calc(f'{price}-{off}', price - off)}."], price - off)


def _legs(rng: random.Random, name: str):
    cows, times = rng.randint(3, 25), rng.randint(2, 6)
    hens = cows * times
    legs = cows * 4 + hens * 2
    return (f"{name}'s farm has {cows} cows and {times} times as many chickens. "
            f"How many legs do the cows and chickens have in total?",
            [f"There are {cows}*{times} = {_calc(f'{cows}*{times}', hens)} chickens.",
             f"The cows have {cows}*4 = {_calc(f'{cows}*4', cows * 4)} legs and the chickens "
             f"{hens}*2 = {_calc(f'{hens}*2', hens * 2)} legs.",
             f"In total {cows * 4}+{hens * 2} = {_calc(f'{cows * 4}+{hens * 2}', legs)} legs."], legs)


def _average(rng: random.Random, name: str):
    a, b = rng.randint(60, 100), rng.randint(60, 100)
    c = next(x for x in range(100, 49, -1) if (a + b + x) % 3 == 0 and x != a)
    total = a + b + c
    return (f"{name} scored {a}, {b} and {c} on three tests. What is {name}'s average score?",
            [f"The total is {a}+{b}+{c} = {_calc(f'{a}+{b}+{c}', total)}.",
             f"The average is {total}/3 = {_calc(f'{total}/3', total // 3)}."], total // 3)


def _distance(rng: random.Random, name: str):
    v1, t1, v2, t2 = rng.randint(4, 12) * 10, rng.randint(1, 5), rng.randint(3, 9) * 10, rng.randint(1, 4)
    d1, d2 = v1 * t1, v2 * t2
    return (f"{name} drives at {v1} km per hour for {t1} hours, then at {v2} km per hour for {t2} hours. "
            f"How many kilometres does {name} drive in total?",
            [f"First {v1}*{t1} = {_calc(f'{v1}*{t1}', d1)} km, then {v2}*{t2} = {_calc(f'{v2}*{t2}', d2)} km.",
             f"In total {d1}+{d2} = {_calc(f'{d1}+{d2}', d1 + d2)} km."], d1 + d2)


def _fraction(rng: random.Random, name: str):
    den = rng.choice((3, 4, 5, 6, 8))
    num = rng.randint(1, den - 1)
    total = den * rng.randint(3, 15)
    part = total * num // den
    return (f"{name} has {total} marbles, and {num}/{den} of them are red. How many of the marbles are not red?",
            [f"{total}*{num}/{den} = {_calc(f'{total}*{num}/{den}', part)} marbles are red.",
             f"So {total}-{part} = {_calc(f'{total}-{part}', total - part)} are not red."], total - part)


def _saving(rng: random.Random, name: str):
    weekly, weeks = rng.randint(3, 25), rng.randint(4, 20)
    cost = weekly * weeks
    return (f"{name} saves ${weekly} every week to buy a game console that costs ${cost}. "
            f"How many weeks does {name} need to save?",
            [f"{name} needs {cost}/{weekly} = {_calc(f'{cost}/{weekly}', weeks)} weeks."], weeks)


def _ages(rng: random.Random, name: str):
    other = rng.choice([n for n in _NAMES if n != name])
    age, extra, years = rng.randint(5, 20), rng.randint(1, 9), rng.randint(2, 10)
    now = 2 * age + extra
    return (f"{name} is {age} years old. {other} is {extra} years older than twice {name}'s age. "
            f"How old will {other} be in {years} years?",
            [f"{other} is 2*{age}+{extra} = {_calc(f'2*{age}+{extra}', now)} years old.",
             f"In {years} years {other} will be {now}+{years} = {_calc(f'{now}+{years}', now + years)}."], now + years)


def _boxes(rng: random.Random, name: str):
    size = rng.randint(4, 12)
    count = size * rng.randint(3, 20) + rng.randint(1, size - 1)  # never a whole number of boxes
    full = count // size
    return (f"{name} packs {count} cupcakes into boxes that hold {size} cupcakes each. "
            f"How many boxes does {name} need to pack all of them?",
            [f"{count}//{size} = {_calc(f'{count}//{size}', full)} boxes are filled, with "
             f"{count}-{full}*{size} = {_calc(f'{count}-{full}*{size}', count - full * size)} cupcakes left over.",
             f"One more box holds the rest: {full}+1 = {_calc(f'{full}+1', full + 1)}."], full + 1)


def _recipe(rng: random.Random, name: str):
    cups, serves, factor = rng.randint(2, 6), rng.randint(2, 6), rng.randint(2, 5)
    wanted = serves * factor
    return (f"A recipe uses {cups} cups of flour for {serves} servings. {name} wants to make {wanted} servings. "
            f"How many cups of flour does {name} need?",
            [f"{wanted} servings is {wanted}/{serves} = {_calc(f'{wanted}/{serves}', factor)} times the recipe.",
             f"{name} needs {cups}*{factor} = {_calc(f'{cups}*{factor}', cups * factor)} cups."], cups * factor)


TEMPLATES: tuple[Callable, ...] = (_change, _half_as_many, _wages, _sharing, _discount, _legs, _average,
                                   _distance, _fraction, _saving, _ages, _boxes, _recipe)
_HELD_OUT = ("dev", "validation", "test")


def generate_problems(seed: int = 0, split: str = "train", num_problems: int = 400,
                      dev_fraction: float = 0.2) -> list[dict]:
    """One split of the generated set: `{"id", "question", "answer"}` with `answer` ending in `#### n`."""
    rng = random.Random(seed)
    problems: list[dict] = []
    seen: dict[str, None] = {}
    attempts = 0
    while len(problems) < num_problems and attempts < num_problems * 20:
        attempts += 1
        template = TEMPLATES[len(problems) % len(TEMPLATES)]  # cycle, so every split mixes all templates
        question, steps, answer = template(rng, rng.choice(_NAMES))
        if question in seen:
            continue
        seen[question] = None
        problems.append({"id": f"gen{seed}-{len(problems):04d}", "question": question,
                         "answer": "\n".join(steps) + f"\n#### {answer}"})
    n_dev = int(round(len(problems) * dev_fraction))
    if split == "train":
        return problems[n_dev:]
    if split in _HELD_OUT:
        return problems[:n_dev]
    raise ValueError(f"the generated set has splits 'train' and 'dev', not {split!r}")
