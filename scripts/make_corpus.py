"""Regenerate tiny_corpus.txt: a seeded mixture of simple English prose (written for Malleus).

The corpus is original generated text (no third-party source), small enough to ship and varied
enough that a byte-level model's loss visibly falls. Run: python scripts/make_corpus.py > trainer/data/tiny_corpus.txt
"""

from __future__ import annotations

import random

PEOPLE = [
    "the miller",
    "the baker",
    "a young sailor",
    "the old shepherd",
    "a tired clerk",
    "the gardener",
    "a curious child",
    "the blacksmith",
    "the weaver",
    "a travelling doctor",
    "the ferryman",
    "the schoolteacher",
    "a quiet fisherman",
    "the innkeeper",
    "the potter",
    "a wandering poet",
    "the lighthouse keeper",
    "the carpenter",
    "a clever fox",
    "an old crow",
    "the farmer's daughter",
    "the mayor",
    "a stranger from the hills",
]
PLACES = [
    "the river",
    "the market",
    "the harbour",
    "the orchard",
    "the mill",
    "the forest",
    "the village square",
    "the old bridge",
    "the hill",
    "the library",
    "the kitchen",
    "the meadow",
    "the church tower",
    "the narrow lane",
    "the shore",
    "the workshop",
]
THINGS = [
    "a basket of apples",
    "a lantern",
    "a letter",
    "a loaf of bread",
    "a wooden box",
    "a silver coin",
    "a map",
    "a bundle of wool",
    "a jar of honey",
    "a broken wheel",
    "a small bell",
    "a book of songs",
    "a pair of boots",
    "a net",
    "a candle",
    "a key",
]
VERBS = [
    "carried",
    "found",
    "lost",
    "mended",
    "sold",
    "stored",
    "painted",
    "counted",
    "opened",
    "wrapped",
    "buried",
    "weighed",
    "borrowed",
    "returned",
    "polished",
    "dropped",
]
ADJ = [
    "cold",
    "bright",
    "grey",
    "quiet",
    "windy",
    "long",
    "warm",
    "strange",
    "early",
    "late",
    "golden",
    "heavy",
    "gentle",
    "rainy",
    "clear",
    "dark",
]
TIMES = [
    "in the morning",
    "at noon",
    "before dawn",
    "after supper",
    "on Sunday",
    "in winter",
    "at the end of summer",
    "late in the evening",
    "on market day",
    "during the storm",
]
WINDS = ["cold", "bitter", "warm", "gentle", "wild", "salty", "northern", "evening"]
FEELINGS = ["glad", "worried", "surprised", "patient", "hungry", "proud", "sleepy", "careful"]
MORALS = [
    "A small kindness is never wasted.",
    "Haste makes a crooked road.",
    "Who listens well learns twice.",
    "A shared loaf feeds more than one.",
    "The patient hand mends the net.",
    "Pride walks ahead and falls first.",
    "Many small steps cross the mountain.",
    "A light kept for others lights the keeper.",
]
SAYINGS = [
    "Good morning",
    "Where are you going",
    "Have you seen my dog",
    "It will rain soon",
    "The bread is still warm",
    "Come in and sit down",
    "I cannot find the key",
    "Let us wait until the tide turns",
    "Thank you for the help",
]


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


def sentence(r: random.Random) -> str:
    p, q = r.sample(PEOPLE, 2)
    k = r.randrange(9)
    if k == 0:
        return f"{cap(p)} {r.choice(VERBS)} {r.choice(THINGS)} near {r.choice(PLACES)} {r.choice(TIMES)}."
    if k == 1:
        return f"It was a {r.choice(ADJ)} day, and {p} walked to {r.choice(PLACES)}."
    if k == 2:
        return f"{cap(p)} was {r.choice(FEELINGS)}, because {q} had {r.choice(VERBS)} {r.choice(THINGS)}."
    if k == 3:
        return f'"{r.choice(SAYINGS)}," said {p} to {q}.'
    if k == 4:
        a, b = r.randrange(2, 40), r.randrange(2, 40)
        return f"{cap(p)} counted {a} and {b} and wrote down {a + b}."
    if k == 5:
        return f"When the {r.choice(WINDS)} wind came over {r.choice(PLACES)}, {p} closed the door."
    if k == 6:
        return f"{cap(q)} gave {p} {r.choice(THINGS)}, and {p} said thank you."
    if k == 7:
        return f"Every day {p} went to {r.choice(PLACES)} and came back {r.choice(TIMES)}."
    return f"Nobody knew why {p} kept {r.choice(THINGS)} in {r.choice(PLACES)}."


def fable(r: random.Random) -> str:
    lines = [sentence(r) for _ in range(r.randrange(4, 9))]
    return " ".join(lines) + " " + r.choice(MORALS)


def main() -> None:
    r = random.Random(20250601)
    out, size, n = [], 0, 0
    while size < 200_000:
        n += 1
        para = f"{n}. " + fable(r) if r.random() < 0.3 else fable(r)
        out.append(para)
        size += len(para) + 2
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
