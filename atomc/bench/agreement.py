"""English agreement minimal pairs, generated deterministically from a seed (BLiMP's shape).

Each row is a grammatical sentence and the same sentence with one agreement broken; a model
scores a row right when it gives the grammatical one the higher log-likelihood (lm-eval's
`multiple_choice` with an empty context, `acc`). Log-likelihood tasks need no generation, so even
a 135M model scores well above chance (50%) and a quantised model's score moves only where its
preference between the two sentences was already close: the regression gate for a format
(`benchmarks/fp8_accuracy.py`) that the arithmetic task cannot be at that size.

Phenomena (each a fifth of the rows):
- `subject_verb_attractor`: the verb agrees with the subject, not with the noun between them;
- `determiner_noun`: this / that with a singular noun, these / those with a plural;
- `reflexive_number`: himself / herself against themselves, by the antecedent's number;
- `existential_there`: there is / are with the noun that follows;
- `irregular_past`: an irregular verb's past tense against its regularised form.

`python -m atomc.bench.agreement` rewrites the shipped data file of the `atomc_agreement` lm-eval
task (atomc/bench/lm_eval_tasks/); a test checks that it equals what this module generates.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

TASK_DIR = Path(__file__).parent / "lm_eval_tasks"
TEST_FILE, SEED, ROWS = "atomc_agreement_test.jsonl", 0, 500

# (singular, plural) nouns for people and things
PEOPLE = [("teacher", "teachers"), ("doctor", "doctors"), ("farmer", "farmers"), ("student", "students"),
          ("pilot", "pilots"), ("singer", "singers"), ("driver", "drivers"), ("writer", "writers"),
          ("child", "children"), ("woman", "women"), ("man", "men"), ("nurse", "nurses")]  # fmt: skip
THINGS = [("book", "books"), ("window", "windows"), ("table", "tables"), ("box", "boxes"), ("car", "cars"),
          ("key", "keys"), ("picture", "pictures"), ("lamp", "lamps"), ("bottle", "bottles"), ("chair", "chairs"),
          ("letter", "letters"), ("cup", "cups")]  # fmt: skip
PLACES = ["kitchen", "garden", "office", "library", "station", "market", "classroom", "park"]
ADJECTIVES = ["tired", "happy", "late", "busy", "ready", "quiet", "hungry", "nervous"]
BE = [("is", "are"), ("was", "were")]  # (singular, plural)
PAST = [("went", "goed"), ("wrote", "writed"), ("ate", "eated"), ("saw", "seed"), ("took", "taked"), ("gave", "gived"),
        ("ran", "runned"), ("found", "finded"), ("brought", "bringed"), ("began", "beginned")]  # fmt: skip
PAST_OBJECTS = {"went": "to the {place}", "wrote": "a letter", "ate": "an apple", "saw": "a bird",
                "took": "the bus", "gave": "a gift", "ran": "to the {place}", "found": "a key",
                "brought": "some bread", "began": "a new book"}  # fmt: skip
NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Lena", "Omar"]


def _subject_verb_attractor(rng: random.Random) -> tuple[str, str]:
    person, thing = rng.choice(PEOPLE), rng.choice(THINGS)
    plural = rng.random() < 0.5  # the subject's number; the attractor takes the other one
    subject, attractor = person[plural], thing[not plural]
    verb = rng.choice(BE)
    adjective = rng.choice(ADJECTIVES)
    good, bad = (verb[1], verb[0]) if plural else (verb[0], verb[1])
    start = f"The {subject} with the {attractor}"
    return f"{start} {good} {adjective}.", f"{start} {bad} {adjective}."


def _determiner_noun(rng: random.Random) -> tuple[str, str]:
    name, noun, place = rng.choice(NAMES), rng.choice(THINGS), rng.choice(PLACES)
    plural = rng.random() < 0.5
    near = rng.random() < 0.5
    singular_det, plural_det = ("this", "these") if near else ("that", "those")
    good, bad = (plural_det, singular_det) if plural else (singular_det, plural_det)
    word = noun[plural]
    return f"{name} put {good} {word} in the {place}.", f"{name} put {bad} {word} in the {place}."


def _reflexive_number(rng: random.Random) -> tuple[str, str]:
    verb = rng.choice(["hurt", "saw", "blamed", "helped", "praised"])
    if rng.random() < 0.5:  # a plural antecedent: themselves, against a singular reflexive
        subject = rng.choice(PEOPLE)[1]
        good, bad = "themselves", rng.choice(["himself", "herself"])
    else:
        subject = rng.choice(PEOPLE)[0]
        good, bad = rng.choice(["himself", "herself"]), "themselves"
    return f"The {subject} {verb} {good}.", f"The {subject} {verb} {bad}."


def _existential_there(rng: random.Random) -> tuple[str, str]:
    thing, place = rng.choice(THINGS), rng.choice(PLACES)
    plural = rng.random() < 0.5
    tense = rng.choice(BE)
    good, bad = (tense[1], tense[0]) if plural else (tense[0], tense[1])
    noun = f"{rng.choice(['two', 'three', 'many', 'some'])} {thing[1]}" if plural else f"a {thing[0]}"
    return f"There {good} {noun} in the {place}.", f"There {bad} {noun} in the {place}."


def _irregular_past(rng: random.Random) -> tuple[str, str]:
    name, (good, bad), place = rng.choice(NAMES), rng.choice(PAST), rng.choice(PLACES)
    rest = PAST_OBJECTS[good].format(place=place)
    when = rng.choice(["Yesterday", "Last week", "This morning"])
    return f"{when}, {name} {good} {rest}.", f"{when}, {name} {bad} {rest}."


PHENOMENA = {
    "subject_verb_attractor": _subject_verb_attractor,
    "determiner_noun": _determiner_noun,
    "reflexive_number": _reflexive_number,
    "existential_there": _existential_there,
    "irregular_past": _irregular_past,
}


def generate(seed: int, n: int) -> list[dict]:
    """`n` rows {"phenomenon", "good", "bad"}, the phenomena in turn, no pair twice."""
    rng = random.Random(seed)
    names = list(PHENOMENA)
    out, seen = [], set()
    while len(out) < n:
        phenomenon = names[len(out) % len(names)]
        good, bad = PHENOMENA[phenomenon](rng)
        if good in seen:
            continue
        seen.add(good)
        out.append({"phenomenon": phenomenon, "good": good, "bad": bad})
    return out


def write_task_data(task_dir: Path = TASK_DIR) -> Path:
    path = task_dir / TEST_FILE
    path.write_text("".join(json.dumps(row) + "\n" for row in generate(SEED, ROWS)))
    return path


if __name__ == "__main__":
    print(f"wrote {write_task_data()}", file=sys.stderr)
