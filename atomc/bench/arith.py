"""GSM8K-style arithmetic word problems, generated deterministically from a seed.

The machines atomc is validated on are often offline, so the accuracy block cannot download
GSM8K. These problems have its shape (a short story, two to four operations on small whole
numbers, a worked answer ending in `#### N`), so lm-eval's GSM8K filters (`strict-match` on
`#### N`, `flexible-extract` on the last number) and exact-match scoring apply unchanged. They
are easier than GSM8K and are no substitute for it when comparing with published scores: they
gate a regression (a quantised model, a new kernel) against the same server's own earlier score.

`python -m atomc.bench.arith` rewrites the shipped data files of the `atomc_arith` lm-eval task
(atomc/bench/lm_eval_tasks/); tests check that the files equal what this module generates.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

TASK_DIR = Path(__file__).parent / "lm_eval_tasks"
# the shipped splits: (file name, seed, number of problems); few-shot examples come from `train`
SPLITS = {"test": ("atomc_arith_test.jsonl", 0, 200), "train": ("atomc_arith_train.jsonl", 1, 16)}

NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hugo",
    "Ines",
    "Jonas",
    "Kemal",
    "Lena",
    "Mateo",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
]
ITEMS = [
    ("apples", "basket"),
    ("marbles", "bag"),
    ("stickers", "sheet"),
    ("pencils", "box"),
    ("cookies", "tray"),
    ("books", "shelf"),
    ("shells", "bucket"),
    ("cards", "pack"),
]


def _buy_give(rng: random.Random) -> tuple[str, list[str], int]:
    name, (item, unit) = rng.choice(NAMES), rng.choice(ITEMS)
    start, packs, per, given = rng.randint(3, 40), rng.randint(2, 6), rng.randint(2, 12), rng.randint(1, 10)
    bought = packs * per
    total = start + bought
    given = min(given, total)
    answer = total - given
    question = (
        f"{name} has {start} {item}. {name} buys {packs} {unit}s with {per} {item} in each {unit}, "
        f"then gives {given} {item} to a friend. How many {item} does {name} have now?"
    )
    steps = [
        f"{name} buys {packs} * {per} = {bought} {item}.",
        f"{name} then has {start} + {bought} = {total} {item}.",
        f"After giving {given} away, {name} has {total} - {given} = {answer} {item}.",
    ]
    return question, steps, answer


def _earn_spend(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    rate, hours, days, spent = rng.randint(5, 25), rng.randint(2, 8), rng.randint(2, 5), rng.randint(5, 60)
    per_day = rate * hours
    earned = per_day * days
    spent = min(spent, earned)
    answer = earned - spent
    question = (
        f"{name} earns ${rate} an hour and works {hours} hours a day for {days} days. "
        f"{name} spends ${spent} on a gift. How many dollars does {name} have left?"
    )
    steps = [
        f"Each day {name} earns {rate} * {hours} = {per_day} dollars.",
        f"In {days} days that is {per_day} * {days} = {earned} dollars.",
        f"After the gift, {name} has {earned} - {spent} = {answer} dollars.",
    ]
    return question, steps, answer


def _share(rng: random.Random) -> tuple[str, list[str], int]:
    name, (item, _unit) = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, extra = rng.randint(2, 9), rng.randint(2, 15), rng.randint(1, 20)
    shared = friends * each
    total = shared + extra
    answer = each
    question = (
        f"{name} had {total} {item}, kept {extra} of them, and shared the rest equally among "
        f"{friends} friends. How many {item} did each friend get?"
    )
    steps = [
        f"{name} shared {total} - {extra} = {shared} {item}.",
        f"Each friend got {shared} / {friends} = {answer} {item}.",
    ]
    return question, steps, answer


def _rows(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    rows, per_row, dead, planted = rng.randint(3, 12), rng.randint(4, 15), rng.randint(1, 9), rng.randint(2, 20)
    grown = rows * per_row
    alive = grown - dead
    answer = alive + planted
    question = (
        f"{name} plants {rows} rows of tulips with {per_row} tulips in each row. {dead} tulips do not "
        f"grow, and later {name} plants {planted} more. How many tulips are growing now?"
    )
    steps = [
        f"{name} planted {rows} * {per_row} = {grown} tulips.",
        f"{grown} - {dead} = {alive} of them grow.",
        f"With {planted} more there are {alive} + {planted} = {answer} tulips.",
    ]
    return question, steps, answer


TEMPLATES = (_buy_give, _earn_spend, _share, _rows)


def generate(seed: int, n: int) -> list[dict]:
    """`n` problems as GSM8K rows: {"question", "answer"}, the answer's last line `#### N`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question, steps, answer = rng.choice(TEMPLATES)(rng)
        out.append({"question": question, "answer": "\n".join(steps) + f"\n#### {answer}"})
    return out


def final_answer(answer: str) -> str:
    return answer.rsplit("#### ", 1)[-1].strip()


def write_task_data(task_dir: Path = TASK_DIR) -> list[Path]:
    paths = []
    for file_name, seed, n in SPLITS.values():
        path = task_dir / file_name
        path.write_text("".join(json.dumps(row) + "\n" for row in generate(seed, n)))
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_task_data():
        print(f"wrote {p}", file=sys.stderr)
