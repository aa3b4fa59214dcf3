"""GSM8K-format problems made up from templates (no GSM8K text in the repository)
and the replies a model could give to them."""
from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ava", "Bo", "Chen", "Dara", "Eli", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemi", "Lars"]
ITEMS = ["apples", "stamps", "marbles", "pencils", "shells", "cards", "buttons", "beads"]


def _problem(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b, c = rng.randint(2, 60), rng.randint(2, 9), rng.randint(2, 12)
        value = a + b * c
        question = (f"{name} has {a} {item}. {name} buys {b} boxes with {c} {item} in each box. "
                    f"How many {item} does {name} have now?")
        steps = (f"The boxes hold {b} * {c} = <<{b}*{c}={b * c}>>{b * c} {item}.\n"
                 f"{name} has {a} + {b * c} = <<{a}+{b * c}={value}>>{value} {item} now.")
    elif kind == 1:
        b, c = rng.randint(2, 9), rng.randint(2, 9)
        a = b * c + rng.randint(1, 90)
        value = a - b * c
        question = (f"{name} had {a} dollars and paid {b} dollars for each of {c} bags of {item}. "
                    f"How many dollars does {name} have left?")
        steps = (f"The bags cost {b} * {c} = <<{b}*{c}={b * c}>>{b * c} dollars.\n"
                 f"{name} has {a} - {b * c} = <<{a}-{b * c}={value}>>{value} dollars left.")
    else:  # large answers, written with thousands commas in the reference
        a, b, c = rng.randint(20, 90), rng.randint(11, 60), rng.randint(3, 9)
        value = a * b * c
        question = (f"A shop packs {a} crates of {item} a week with {b} {item} in each crate. "
                    f"How many {item} does it pack in {c} weeks?")
        steps = (f"Each week it packs {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}.\n"
                 f"In {c} weeks that is {a * b} * {c} = <<{a * b}*{c}={value}>>{value} {item}.")
        return {"question": question, "answer": f"{steps}\n#### {value:,}", "value": value}
    return {"question": question, "answer": f"{steps}\n#### {value}", "value": value}


def make_problems(rng: random.Random, count: int, avoid: set[str] = frozenset()) -> list[dict]:
    out, seen = [], set(avoid)
    while len(out) < count:
        p = _problem(rng)
        if p["question"] not in seen:
            seen.add(p["question"])
            out.append(p)
    return out


def write_gsm8k(folder: Path, rng: random.Random, n_train: int = 6, n_test: int = 24):
    """train.jsonl and test.jsonl as GSM8K has them (question, answer)."""
    train = make_problems(rng, n_train)
    test = make_problems(rng, n_test, avoid={p["question"] for p in train})
    folder.mkdir(parents=True, exist_ok=True)
    for name, split in (("train", train), ("test", test)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for p in split:
                f.write(json.dumps({"question": p["question"], "answer": p["answer"]}) + "\n")
    return train, test


# What the model says after "Answer:". The text past the blank line is what a
# model would go on to invent; the server cuts it at the stop string.
_AFTER = "\n\nQuestion: Tom has 3 cats. How many cats?\nAnswer: #### 3"
MODES = {
    "right": lambda p: f" {p['answer']}{_AFTER}",                        # strict and flexible right
    "flexible_only": lambda p: f" Adding it up gives {p['value']:,}.{_AFTER}",   # no '####'
    "strict_only": lambda p: f" #### {p['value']}\nThat is {p['value'] + 1} with one more.{_AFTER}",
    "wrong": lambda p: f" {p['answer'].rsplit('####', 1)[0]}#### {p['value'] + 3}{_AFTER}",
}


def assign_replies(rng: random.Random, test: list[dict], counts: dict[str, int]):
    """question -> reply, and the exact (strict, flexible) accuracies those replies earn."""
    modes = [m for m, n in counts.items() for _ in range(n)]
    assert len(modes) == len(test)
    rng.shuffle(modes)
    key = {p["question"]: MODES[m](p) for p, m in zip(test, modes)}
    strict = (counts.get("right", 0) + counts.get("strict_only", 0)) / len(test)
    flexible = (counts.get("right", 0) + counts.get("flexible_only", 0)) / len(test)
    return key, strict, flexible
