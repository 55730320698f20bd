"""The built-in style dataset: questions from templated facts, each with a terse and a verbose answer.

Answers are written from the same fact, so both styles say the same thing and differ only in length.
`python -m attnlab.finetune.style_data DIR` rewrites train.jsonl, val.jsonl and heldout.jsonl.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from attnlab.outputs import replace_file

TERSE, VERBOSE = "<STYLE_TERSE>", "<STYLE_VERBOSE>"

CAPITALS = [("France", "Paris", "Europe"), ("Japan", "Tokyo", "Asia"), ("Kenya", "Nairobi", "Africa"), ("Peru", "Lima", "South America"),
            ("Canada", "Ottawa", "North America"), ("Egypt", "Cairo", "Africa"), ("Italy", "Rome", "Europe"), ("Spain", "Madrid", "Europe"),
            ("Germany", "Berlin", "Europe"), ("India", "New Delhi", "Asia"), ("China", "Beijing", "Asia"), ("Brazil", "Brasilia", "South America"),
            ("Chile", "Santiago", "South America"), ("Norway", "Oslo", "Europe"), ("Sweden", "Stockholm", "Europe"), ("Ghana", "Accra", "Africa"),
            ("Mexico", "Mexico City", "North America"), ("Thailand", "Bangkok", "Asia"), ("Portugal", "Lisbon", "Europe"), ("Greece", "Athens", "Europe"),
            ("Austria", "Vienna", "Europe"), ("Poland", "Warsaw", "Europe"), ("Vietnam", "Hanoi", "Asia"), ("Morocco", "Rabat", "Africa"),
            ("Argentina", "Buenos Aires", "South America"), ("Ireland", "Dublin", "Europe"), ("Finland", "Helsinki", "Europe"),
            ("Turkey", "Ankara", "Asia"), ("Cuba", "Havana", "North America"), ("Nigeria", "Abuja", "Africa")]
ELEMENTS = [("hydrogen", "H", 1), ("helium", "He", 2), ("lithium", "Li", 3), ("carbon", "C", 6), ("nitrogen", "N", 7), ("oxygen", "O", 8),
            ("neon", "Ne", 10), ("sodium", "Na", 11), ("magnesium", "Mg", 12), ("aluminium", "Al", 13), ("silicon", "Si", 14),
            ("sulfur", "S", 16), ("chlorine", "Cl", 17), ("argon", "Ar", 18), ("potassium", "K", 19), ("calcium", "Ca", 20), ("iron", "Fe", 26),
            ("copper", "Cu", 29), ("zinc", "Zn", 30), ("silver", "Ag", 47), ("tin", "Sn", 50), ("gold", "Au", 79), ("mercury", "Hg", 80),
            ("lead", "Pb", 82), ("uranium", "U", 92)]
ANIMALS = [("dog", "mammal", "meat and other food"), ("cat", "mammal", "meat"), ("cow", "mammal", "grass"), ("eagle", "bird", "small animals"),
           ("shark", "fish", "other fish"), ("frog", "amphibian", "insects"), ("snake", "reptile", "small animals"), ("horse", "mammal", "grass and hay"),
           ("owl", "bird", "mice"), ("whale", "mammal", "krill and fish"), ("bee", "insect", "nectar"), ("rabbit", "mammal", "plants"),
           ("penguin", "bird", "fish"), ("turtle", "reptile", "plants and small animals"), ("salmon", "fish", "insects and small fish"),
           ("ant", "insect", "sugar and seeds"), ("lion", "mammal", "meat"), ("duck", "bird", "plants and insects"), ("lizard", "reptile", "insects"),
           ("goat", "mammal", "plants")]


def facts() -> list[tuple[str, str, str]]:
    """(question, terse answer, verbose answer) triples."""
    out = []
    for country, capital, continent in CAPITALS:
        out.append((f"What is the capital of {country}?", f"{capital}.",
                    f"The capital of {country} is {capital}. {country} is a country in {continent}, and {capital} is the city where its "
                    f"national government meets. Many people visit {capital} to see its museums, its old streets and its markets, "
                    f"and it is one of the best known cities in {continent}."))
        out.append((f"Which continent is {country} in?", f"{continent}.",
                    f"{country} is in {continent}. Its capital city is {capital}. Like its neighbours in {continent}, {country} has "
                    f"its own history, language and food, and it trades with many countries around the world."))
    for name, symbol, number in ELEMENTS:
        out.append((f"What is the chemical symbol of {name}?", f"{symbol}.",
                    f"The chemical symbol of {name} is {symbol}. Every element has a short symbol of one or two letters, and chemists "
                    f"use {symbol} for {name} when they write formulas. {name.capitalize()} has the atomic number {number}, which is "
                    f"the number of protons in the nucleus of each of its atoms."))
        out.append((f"What is the atomic number of {name}?", f"{number}.",
                    f"The atomic number of {name} is {number}. This means that every atom of {name} has {number} protons in its "
                    f"nucleus. In the periodic table, {name} is written with the symbol {symbol}, and the elements are ordered by "
                    f"this number from the lightest to the heaviest."))
    for animal, kind, food in ANIMALS:
        article = "an" if kind[0] in "aeiou" else "a"
        out.append((f"What kind of animal is a {animal}?", f"{article.capitalize()} {kind}.",
                    f"A {animal} is {article} {kind}. Scientists group animals by the features they share, and the {animal} has the "
                    f"features of {article} {kind}. It lives in many parts of the world, and people often learn about it at school "
                    f"or see it in books, films and zoos."))
        out.append((f"What does a {animal} eat?", f"{food.capitalize()}.",
                    f"A {animal} mostly eats {food}. What an animal eats depends on its body, its teeth and where it lives. The {animal} "
                    f"is {article} {kind}, and finding {food} takes up a large part of its day, so its habits follow its food."))
    rng = random.Random(0)
    for _ in range(60):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        out.append((f"What is {a} plus {b}?", f"{a + b}.",
                    f"{a} plus {b} is {a + b}. To add the two numbers, start from {a} and count on {b} more, which gives {a + b}. "
                    f"You can check the answer by taking {b} away from {a + b}, which gives {a} again, so the sum is right."))
    return out


def rows_for(items, style: str | None = None) -> list[dict]:
    rows = []
    for q, terse, verbose in items:
        if style in (None, "terse"):
            rows.append({"prompt": f"{TERSE} {q}", "completion": terse})
        if style in (None, "verbose"):
            rows.append({"prompt": f"{VERBOSE} {q}", "completion": verbose})
    return rows


def write_style_dataset(directory: Path) -> dict[str, int]:
    items = facts()
    random.Random(1).shuffle(items)
    heldout, val, train = items[:30], items[30:50], items[50:]
    directory.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, part in (("train", train), ("val", val), ("heldout", heldout)):
        rows = rows_for(part)
        if name == "train":
            random.Random(2).shuffle(rows)
        replace_file(directory / f"{name}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        counts[name] = len(rows)
    return counts


if __name__ == "__main__":
    print(write_style_dataset(Path(sys.argv[1])))
