"""The multiple-choice task of ``benchmarks/lm_eval_mc.py``: 60 questions of our own.

Five kinds of twelve questions (capitals, opposites, young animals, colours, and
alternately sums and weekdays), four choices each, drawn from the tables below with a
fixed seed, so the files in ``benchmarks/data/lm_eval_mc/`` can always be regenerated
byte for byte. Standard library only.
"""

from __future__ import annotations

import json
import random
from typing import Any

from bench_common import BENCH_DIR, log

DATA_DIR = BENCH_DIR / "data" / "lm_eval_mc"
TASK = "kvstack_mc"
SEED = 20261201

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Germany", "Berlin"), ("Egypt", "Cairo"), ("Russia", "Moscow"),
            ("England", "London"), ("Greece", "Athens"), ("China", "Beijing"),
            ("Canada", "Ottawa"), ("Portugal", "Lisbon")]  # fmt: skip
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"),
             ("happy", "sad"), ("day", "night"), ("open", "closed"), ("light", "dark"),
             ("old", "young"), ("early", "late"), ("full", "empty"), ("hard", "soft")]  # fmt: skip
YOUNG = [("cat", "kitten"), ("dog", "puppy"), ("cow", "calf"), ("horse", "foal"),
         ("sheep", "lamb"), ("duck", "duckling"), ("frog", "tadpole"), ("goat", "kid"),
         ("bear", "cub"), ("pig", "piglet"), ("swan", "cygnet"), ("hen", "chick")]  # fmt: skip
COLOURS = [("the sky on a clear day", "blue"), ("fresh grass", "green"), ("snow", "white"),
           ("a ripe banana", "yellow"), ("coal", "black"), ("a ripe tomato", "red"),
           ("an orange", "orange"), ("milk", "white"), ("a lemon", "yellow"),
           ("a stop sign", "red"), ("a crow", "black"), ("a lime", "green")]  # fmt: skip
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def make_questions(seed: int = SEED) -> list[dict[str, Any]]:
    """60 four-choice questions (five kinds of twelve), choices shuffled with ``seed``."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []

    def add(question: str, answer: str, pool: list[str]) -> None:
        wrong = rng.sample(sorted({p for p in pool if p != answer}), 3)
        choices = [answer, *wrong]
        rng.shuffle(choices)
        out.append({"question": question, "choices": choices, "answer": choices.index(answer)})

    for country, city in CAPITALS:
        add(f"What is the capital of {country}?", city, [c for _, c in CAPITALS])
    for word, opp in OPPOSITES:
        add(f"What is the opposite of '{word}'?", opp, [o for _, o in OPPOSITES])
    for animal, baby in YOUNG:
        add(f"What is a young {animal} called?", baby, [b for _, b in YOUNG])
    for thing, colour in COLOURS:
        add(f"What colour is {thing}?", colour, sorted({c for _, c in COLOURS}))
    for i in range(12):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        if i % 2:
            add(f"What is {a} plus {b}?", str(a + b), [str(a + b + d) for d in (-2, -1, 1, 2, 10)])
        else:
            d = rng.randrange(7)
            add(f"What day comes after {DAYS[d]}?", DAYS[(d + 1) % 7], DAYS)
    for i, q in enumerate(out):
        q["id"] = i
    return out


TASK_YAML = f"""\
# A 60-question multiple-choice task of kvstack's own (benchmarks/lm_eval_mc.py writes it).
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: questions.jsonl  # resolved against this folder by benchmarks/lm_eval_mc.py
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def ensure_task(regenerate: bool) -> list[dict[str, Any]]:
    """The task files, written when missing; an error when they differ from the tables."""
    questions = make_questions()
    want = {
        "questions.jsonl": "".join(json.dumps(q) + "\n" for q in questions),
        f"{TASK}.yaml": TASK_YAML,
    }
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in want.items():
        path = DATA_DIR / name
        if path.exists() and path.read_text() != text and not regenerate:
            raise SystemExit(f"{path} differs from what this script generates: --regenerate")
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            log(f"wrote {path}")
    return questions
