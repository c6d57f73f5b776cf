"""Writes ``instructions.jsonl``: the fine-tuning job's embedded instruction set.

Short string tasks a byte-level model can learn from a few hundred examples (spell a word
backwards, upper-case it, repeat it, count its letters, name its first/last letter), on words drawn
from a fixed list. Deterministic: ``python examples/data/make_instructions.py`` rewrites the same
file byte for byte. The examples are shuffled, so the held-out tail (--val-fraction) is a fair
sample of every task.
"""
from __future__ import annotations

import json
import os
import random

WORDS = """river stone apple bread candle garden window silver paper winter summer forest mountain
valley meadow harbor island castle letter market orange purple yellow rabbit turtle falcon
spider dragon pepper ginger butter honey lemon cherry violet marble copper anchor basket
button carpet pencil ladder mirror needle pillow rocket saddle tunnel wagon whistle bottle
cotton feather hammer kettle lantern mitten parrot pocket puzzle ribbon shadow thunder timber
velvet walnut zipper planet comet meteor nickel cobalt sulfur quartz granite pebble canyon
desert glacier lagoon prairie tundra jungle""".split()


def tasks(word: str) -> list[tuple[str, str]]:
    return [
        (f"Spell backwards: {word}", word[::-1]),
        (f"Write in capitals: {word}", word.upper()),
        (f"Repeat twice: {word}", f"{word} {word}"),
        (f"How many letters in: {word}", str(len(word))),
        (f"First letter of: {word}", word[0]),
        (f"Last letter of: {word}", word[-1]),
    ]


def main() -> None:
    pairs = [p for w in WORDS for p in tasks(w)]
    random.Random(12).shuffle(pairs)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "instructions.jsonl")
    with open(path, "w") as f:
        for prompt, response in pairs:
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    print(f"wrote {len(pairs)} examples to {path}")


if __name__ == "__main__":
    main()
