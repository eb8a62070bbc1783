"""A built-in multi-hop QA set, generated from a seed: an invented world and questions about it.

It lets the environment (and every test) run with no download and no files. Entities have made-up names,
so a model can only answer by searching, never from memory; every question needs two paragraphs
(bridge: follow a link from the first to the second; comparison: read the same fact for two entities),
and each sample's context holds its two gold paragraphs among distractors, like HotpotQA's distractor
setting. Everything is drawn from one `random.Random(seed)` in a fixed order, so a seed names one dataset.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["generate_samples", "DISTRACTORS"]

DISTRACTORS = 8
_SYLLABLES = (
    "ka lo mir ven dra sol tor el an ri bel gar nis ost ul pha rem quin vy zan dor lis mar tha ber "
    "cov fen hal jor kes wen tam sib orn yel pra gu"
).split()
_INDUSTRIES = {
    "Systems": "software", "Motors": "automotive", "Foods": "food", "Textiles": "textile",
    "Shipping": "shipping", "Pharma": "pharmaceutical", "Energy": "energy", "Press": "publishing",
}
_PROFESSIONS = ("engineer", "chemist", "architect", "economist", "painter", "physician", "inventor", "pilot")


@dataclass
class _Entity:
    kind: str
    name: str
    facts: dict = field(default_factory=dict)
    sentences: list[str] = field(default_factory=list)


class _Namer:
    """Unique invented names; uniqueness is checked across every kind of entity."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: dict[str, None] = {}

    def word(self, low: int = 2, high: int = 3, suffix: str = "") -> str:
        while True:
            parts = [self.rng.choice(_SYLLABLES) for _ in range(self.rng.randint(low, high))]
            name = ("".join(parts) + suffix).capitalize()
            if name.lower() not in self.used:
                self.used[name.lower()] = None
                return name


def _build_world(rng: random.Random) -> dict[str, list[_Entity]]:
    namer = _Namer(rng)
    seas = [f"{namer.word(2, 2)} Sea" for _ in range(5)]
    countries = [_Entity("country", namer.word(2, 2, rng.choice(("ia", "and", "ora")))) for _ in range(10)]
    cities = [_Entity("city", namer.word(2, 3, rng.choice(("", "ford", "holm", "gard")))) for _ in range(40)]
    rivers = [_Entity("river", f"{namer.word(2, 2)} River") for _ in range(14)]
    people = [_Entity("person", f"{namer.word(2, 2)} {namer.word(2, 3)}") for _ in range(90)]
    suffixes = list(_INDUSTRIES)
    companies = [_Entity("company", f"{namer.word(2, 3)} {rng.choice(suffixes)}") for _ in range(50)]

    # Distinct numbers per kind keep every comparison question decidable.
    for country, year in zip(countries, rng.sample(range(1810, 1990), len(countries))):
        country.facts.update(sea=rng.choice(seas), language=namer.word(2, 2, "ic"), year=year)
    for i, city in enumerate(cities):
        # Round-robin first, so every country has cities and a capital among them.
        country = countries[i] if i < len(countries) else rng.choice(countries)
        city.facts["country"] = country
        country.facts.setdefault("capital", city)
    for city, year, pop in zip(cities, rng.sample(range(900, 1900), 40), rng.sample(range(20, 2000), 40)):
        city.facts.update(founded=year, population=pop * 1000)
    river_cities = rng.sample(cities, 28)
    for i, river in enumerate(rivers):
        river.facts.update(cities=river_cities[2 * i : 2 * i + 2], sea=rng.choice(seas))
        for city in river.facts["cities"]:
            city.facts["river"] = river
    for river, length in zip(rivers, rng.sample(range(80, 3000), len(rivers))):
        river.facts["length"] = length
    for person, year in zip(people, rng.sample(range(1900, 2000), len(people))):
        person.facts.update(born=year, city=rng.choice(cities), profession=rng.choice(_PROFESSIONS))
    founders = rng.sample(people, len(companies))
    for company, founder, year in zip(companies, founders, rng.sample(range(1920, 2020), len(companies))):
        founder_year = founder.facts["born"]
        company.facts.update(
            founder=founder,
            founded=max(year, founder_year + 22),  # nobody founds a company as a child
            city=rng.choice(cities),
            industry=_INDUSTRIES[company.name.split()[-1]],
            staff=rng.randint(12, 900) * 10,
        )
    # The clamp above can collide founding years; nudge until distinct, deterministically.
    taken: dict[int, None] = {}
    for company in companies:
        while company.facts["founded"] in taken:
            company.facts["founded"] += 1
        taken[company.facts["founded"]] = None

    for c in countries:
        f = c.facts
        c.sentences = [f"{c.name} is a country on the coast of the {f['sea']}.",
                       f"Its capital is {f['capital'].name}.",
                       f"Its official language is {f['language']}.",
                       f"It became independent in {f['year']}."]
    for c in cities:
        f = c.facts
        c.sentences = [f"{c.name} is a city in {f['country'].name} with a population of about {f['population']:,}.",
                       f"It was founded in {f['founded']}."]
        if "river" in f:
            c.sentences.append(f"The {f['river'].name} flows through the city.")
    for r in rivers:
        f = r.facts
        r.sentences = [f"The {r.name} is a river {f['length']} kilometres long.",
                       f"It flows through {' and '.join(c.name for c in f['cities'])}.",
                       f"It empties into the {f['sea']}."]
    for p in people:
        f = p.facts
        p.sentences = [f"{p.name} (born {f['born']}) is a {f['profession']}.",
                       f"{p.name.split()[-1]} was born in {f['city'].name}, {f['city'].facts['country'].name}."]
    for c in companies:
        f = c.facts
        c.sentences = [f"{c.name} is a {f['industry']} company founded in {f['founded']} by {f['founder'].name}.",
                       f"Its headquarters are in {f['city'].name}.",
                       f"It employs about {f['staff']} people."]
    return {"country": countries, "city": cities, "river": rivers, "person": people, "company": companies}


def _bridge_questions(world: dict[str, list[_Entity]]) -> list[list[tuple]]:
    """One pool per question template; each item is (type, question, answer, gold_a, gold_b)."""
    pools: list[list[tuple]] = [[], [], [], [], []]
    for c in world["company"]:
        founder = c.facts["founder"]
        country = founder.facts["city"].facts["country"]
        pools[0].append(("bridge", f"In which country was the founder of {c.name} born?", country.name, c, founder))
        pools[1].append(("bridge", f"In what year was the founder of {c.name} born?",
                         str(founder.facts["born"]), c, founder))
        hq = c.facts["city"]
        pools[2].append(("bridge", f"In what year was the city where {c.name} is headquartered founded?",
                         str(hq.facts["founded"]), c, hq))
    for p in world["person"]:
        country = p.facts["city"].facts["country"]
        pools[3].append(("bridge", f"What is the capital of the country where {p.name} was born?",
                         country.facts["capital"].name, p, country))
    for city in world["city"]:
        river = city.facts.get("river")
        if river is not None:
            pools[4].append(("bridge", f"How many kilometres long is the river that flows through {city.name}?",
                             str(river.facts["length"]), city, river))
            pools[4].append(("bridge", f"Into which sea does the river that flows through {city.name} empty?",
                             river.facts["sea"], city, river))
    return pools


def _comparison_questions(world: dict[str, list[_Entity]], rng: random.Random, per_pool: int) -> list[list[tuple]]:
    def pairs(kind: str) -> list[tuple[_Entity, _Entity]]:
        items = world[kind]
        return [tuple(rng.sample(items, 2)) for _ in range(per_pool)]

    pools: list[list[tuple]] = [[], [], [], [], []]
    for a, b in pairs("company"):
        first = a if a.facts["founded"] < b.facts["founded"] else b
        pools[0].append(("comparison", f"Which company was founded first, {a.name} or {b.name}?", first.name, a, b))
    def country_of(person: _Entity) -> _Entity:
        return person.facts["city"].facts["country"]

    for i, (a, b) in enumerate(pairs("person")):
        older = a if a.facts["born"] < b.facts["born"] else b
        pools[1].append(("comparison", f"Who was born earlier, {a.name} or {b.name}?", older.name, a, b))
        if i % 2 == 0:
            # Random pairs rarely share a country; pair every other one on purpose so yes/no is balanced.
            compatriots = [p for p in world["person"] if p is not a and country_of(p) is country_of(a)]
            b = rng.choice(compatriots) if compatriots else b
        same = country_of(a) is country_of(b)
        pools[4].append(("comparison", f"Were {a.name} and {b.name} born in the same country?",
                         "yes" if same else "no", a, b))
    for a, b in pairs("river"):
        longer = a if a.facts["length"] > b.facts["length"] else b
        pools[2].append(("comparison", f"Which river is longer, the {a.name} or the {b.name}?", longer.name, a, b))
    for a, b in pairs("city"):
        bigger = a if a.facts["population"] > b.facts["population"] else b
        pools[3].append(("comparison", f"Which city has the larger population, {a.name} or {b.name}?",
                         bigger.name, a, b))
    return pools


def _interleave(pools: list[list[tuple]], rng: random.Random) -> list[tuple]:
    """Shuffle each pool, then take one from each in turn so every split mixes all templates."""
    for pool in pools:
        rng.shuffle(pool)
    out, seen = [], {}
    for i in range(max(len(p) for p in pools)):
        for pool in pools:
            if i < len(pool) and pool[i][1] not in seen:
                seen[pool[i][1]] = None
                out.append(pool[i])
    return out


def _context(gold: tuple[_Entity, _Entity], world: dict[str, list[_Entity]], rng: random.Random) -> list:
    """Two gold paragraphs plus distractors: half of the same kinds as the gold ones (hard), half any."""
    gold_names = {gold[0].name, gold[1].name}
    same_kind = [e for kind in dict.fromkeys((gold[0].kind, gold[1].kind)) for e in world[kind]
                 if e.name not in gold_names]
    picked = rng.sample(same_kind, DISTRACTORS // 2)
    names = gold_names | {e.name for e in picked}
    everything = [e for kind in world for e in world[kind] if e.name not in names]
    picked += rng.sample(everything, DISTRACTORS - len(picked))
    paragraphs = [gold[0], gold[1], *picked]
    rng.shuffle(paragraphs)
    return [[e.name, list(e.sentences)] for e in paragraphs]


def generate_samples(seed: int = 0, split: str = "train", num_questions: int = 400,
                     dev_fraction: float = 0.2) -> list[dict]:
    """The samples of one split of the generated set; train and dev share a world, never a question."""
    rng = random.Random(seed)
    world = _build_world(rng)
    pools = _bridge_questions(world) + _comparison_questions(world, rng, per_pool=60)
    questions = _interleave(pools, rng)[:num_questions]
    n_dev = int(round(len(questions) * dev_fraction))
    if split == "train":
        chosen = list(enumerate(questions))[n_dev:]
    elif split in ("dev", "validation"):
        chosen = list(enumerate(questions))[:n_dev]
    else:
        raise ValueError(f"the generated set has splits 'train' and 'dev', not {split!r}")
    samples = []
    for index, (qtype, question, answer, a, b) in chosen:
        # A per-question generator: a sample's context does not depend on which split or limit asked.
        ctx_rng = random.Random(f"{seed}:{index}")
        samples.append({
            "id": f"gen{seed}-{index:04d}",
            "question": question,
            "answer": answer,
            "type": qtype,
            "context": _context((a, b), world, ctx_rng),
            "supporting_facts": [[a.name, 0], [b.name, 0]],
        })
    return samples
