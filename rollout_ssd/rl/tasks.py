"""The recipes' verifiable tasks, generated locally (no downloads) so a run needs nothing but this repo.

"arithmetic": short English word problems over two integer operands and one of + - *, drawn from a
handful of templates; the reward is exact match on the last integer of the completion. "digits": a
trivially learnable sanity task (write digits; reward = share of digit characters) for tests and smoke
runs, where the learning signal must show up in a few steps.

Every prompt uses only the characters of `ALPHABET`, because the `--tiny` preset's character-level
tokenizer is built from it (`rl/tiny.py`); a character outside it would become <unk>.

Rows are a pure function of (num, seed, options): one `random.Random(seed)` draws them in order, so
the same arguments give the same dataset on every machine and Python version.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from typing import Callable, Optional

import datasets

# Every character a prompt may contain (no repeats: the tiny tokenizer maps one token per character).
ALPHABET: str = string.ascii_letters + string.digits + " .,?!:'+-*="
OPS: tuple[str, ...] = ("+", "-", "*")
INSTRUCTION = "Answer with a number only."
NAMES = ("Tom", "Anna", "Sam", "Maya", "Ben", "Lily")
ITEMS = ("apples", "pencils", "marbles", "cookies", "stickers", "books")
DIGIT_PROMPTS = ("Write digits:", "Digits:", "Write some digits:", "Numbers only:")


@dataclass(frozen=True)
class Template:
    """One word problem for `op`: `text` has {a}, {b} (operands, in order a op b), {name} and {item}.
    ordered: swap the operands so that a >= b (for stories where a negative answer makes no sense)."""

    op: str
    text: str
    ordered: bool = False


TEMPLATES: tuple[Template, ...] = (
    Template("+", "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"),
    Template("+", "There are {a} {item} in a box. {name} puts in {b} more. How many {item} are in the box?"),
    Template("+", "What is {a} + {b}?"),
    Template("-", "{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?", ordered=True),
    Template("-", "The temperature is {a} degrees. It drops by {b} degrees. What is the temperature now?"),
    Template("-", "What is {a} - {b}?"),
    Template("*", "{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?"),
    Template("*", "A shelf has {a} rows of {b} {item}. How many {item} are on the shelf?"),
    Template("*", "What is {a} * {b}?"),
)

_APPLY: dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

# An optional minus (only when not glued to a word or number: "5-3" is 5 and 3), then either a number
# with thousands separators ("1,000" but not "1,0000") or a plain run of digits.
_INTEGER = re.compile(r"(?:(?<![0-9A-Za-z])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)")


def _check_num(num: int) -> None:
    if not isinstance(num, int) or isinstance(num, bool) or num < 1:
        raise ValueError(f"num must be an integer >= 1, got {num!r}")


def arithmetic_dataset(
    num: int, seed: int = 0, max_operand: int = 20, ops: tuple[str, ...] = OPS
) -> datasets.Dataset:
    """`num` word problems with operands in 1..max_operand. Columns: prompt (str), answer (str of the
    integer; negative only possible when "-" is in ops), question_id (int, 0..num-1)."""
    _check_num(num)
    if not isinstance(max_operand, int) or isinstance(max_operand, bool) or max_operand < 1:
        raise ValueError(f"max_operand must be an integer >= 1, got {max_operand!r}")
    ops = tuple(ops)
    unknown = sorted(set(ops) - set(OPS))
    if not ops or unknown:
        raise ValueError(f"ops must be a non-empty tuple drawn from {OPS}, got {ops!r} (unknown: {unknown})")
    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(num):
        op = rng.choice(ops)
        template = rng.choice([t for t in TEMPLATES if t.op == op])
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if template.ordered and a < b:
            a, b = b, a
        text = template.text.format(a=a, b=b, name=rng.choice(NAMES), item=rng.choice(ITEMS))
        prompts.append(f"{text} {INSTRUCTION}")
        answers.append(str(_APPLY[op](a, b)))
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": answers, "question_id": list(range(num))})


def digits_dataset(num: int, seed: int = 0) -> datasets.Dataset:
    """`num` rows of "write digits" prompts (a few variants), answer "" (the reward reads only the
    completion). Same columns as `arithmetic_dataset`."""
    _check_num(num)
    rng = random.Random(seed)
    prompts = [rng.choice(DIGIT_PROMPTS) for _ in range(num)]
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": [""] * num, "question_id": list(range(num))})


def extract_answer(text: str) -> Optional[int]:
    """The last integer in `text` ("-7" is negative, "1,000" is 1000), or None when there is none.
    Decimals are not special: the last integer of "3.5" is 5."""
    matches = _INTEGER.findall(text)
    if not matches:
        return None
    return int(matches[-1].replace(",", ""))


def exact_match(completion: str, answer: str) -> float:
    """1.0 iff the completion's last integer equals int(answer), else 0.0."""
    return 1.0 if extract_answer(completion) == int(answer) else 0.0


def digit_share(completion: str, answer: str) -> float:
    """Share of the completion's characters that are ASCII digits (0.0 when empty); `answer` unused."""
    if not completion:
        return 0.0
    return sum(ch in string.digits for ch in completion) / len(completion)


Reward = Callable[[str, str], float]
TASKS: dict[str, tuple[Callable[..., datasets.Dataset], Reward]] = {
    "arithmetic": (arithmetic_dataset, exact_match),
    "digits": (digits_dataset, digit_share),
}


def get_task(name: str) -> tuple[Callable[..., datasets.Dataset], Reward]:
    """(dataset builder, reward function) of task `name`."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    return TASKS[name]
