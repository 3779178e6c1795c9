"""RL tasks (rollout_ssd/rl/tasks.py): datasets deterministic per seed, every arithmetic answer recomputed
from the numbers parsed back out of its prompt, prompts inside ALPHABET, answer extraction, rewards, the
registry, and bad input refused. All deterministic (no test here can fail by chance)."""

from __future__ import annotations

import operator
import re

import pytest

from rollout_ssd.rl.tasks import (
    ALPHABET,
    DIGIT_PROMPTS,
    INSTRUCTION,
    TASKS,
    TEMPLATES,
    arithmetic_dataset,
    digit_share,
    digits_dataset,
    exact_match,
    extract_answer,
    get_task,
)

PY_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _template_regex(text: str) -> re.Pattern:
    """A template's text as a regex capturing a and b; {name} and {item} match words (first use only)."""
    pattern = re.escape(text + " " + INSTRUCTION)
    for field in ("a", "b"):
        pattern = pattern.replace(re.escape("{" + field + "}"), f"(?P<{field}>[0-9]+)")
    for field in ("name", "item"):
        escaped = re.escape("{" + field + "}")
        pattern = pattern.replace(escaped, f"(?P<{field}>[A-Za-z]+)", 1).replace(escaped, f"(?P={field})")
    return re.compile(pattern)


PARSERS = [(t.op, t.ordered, _template_regex(t.text)) for t in TEMPLATES]


def _recompute(prompt: str) -> tuple[str, int, int, bool]:
    """(op, a, b, ordered) of the one template that produced `prompt`."""
    hits = [(op, int(m["a"]), int(m["b"]), ordered) for op, ordered, rx in PARSERS if (m := rx.fullmatch(prompt))]
    assert len(hits) == 1, f"{prompt!r} matches {len(hits)} templates"
    return hits[0]


def test_arithmetic_answers_recomputed_from_prompts():
    ds = arithmetic_dataset(300, seed=3, max_operand=12)
    assert ds.column_names == ["prompt", "answer", "question_id"]
    assert list(ds["question_id"]) == list(range(300))
    ops_seen = set()
    for prompt, answer in zip(ds["prompt"], ds["answer"]):
        op, a, b, ordered = _recompute(prompt)
        assert 1 <= a <= 12 and 1 <= b <= 12
        assert not ordered or a >= b
        assert answer == str(PY_OPS[op](a, b))
        assert exact_match(f"The answer is {answer}.", answer) == 1.0
        ops_seen.add(op)
    assert ops_seen == {"+", "-", "*"}
    assert any(int(a) < 0 for a in ds["answer"])  # fixed seed: 300 rows hold negative differences


def test_arithmetic_deterministic_per_seed():
    first, again, other = arithmetic_dataset(50, seed=7), arithmetic_dataset(50, seed=7), arithmetic_dataset(50, seed=8)
    assert first.to_dict() == again.to_dict()
    assert list(first["prompt"]) != list(other["prompt"])
    assert digits_dataset(20, seed=1).to_dict() == digits_dataset(20, seed=1).to_dict()


@pytest.mark.parametrize("ops", [("+",), ("*",), ("+", "*")])
def test_no_negative_answers_without_minus(ops):
    ds = arithmetic_dataset(200, seed=0, ops=ops)
    assert all(int(a) >= 1 for a in ds["answer"])
    assert {_recompute(p)[0] for p in ds["prompt"]} == set(ops)


def test_prompts_inside_alphabet():
    assert len(set(ALPHABET)) == len(ALPHABET)
    prompts = list(arithmetic_dataset(500, seed=1, max_operand=1000)["prompt"]) + list(digits_dataset(50)["prompt"])
    used = set("".join(prompts))
    assert used <= set(ALPHABET), sorted(used - set(ALPHABET))
    assert max(map(len, prompts)) <= 160  # the tiny preset's context is 256 positions


def test_digits_dataset():
    ds = digits_dataset(40, seed=2)
    assert ds.column_names == ["prompt", "answer", "question_id"]
    assert set(ds["prompt"]) <= set(DIGIT_PROMPTS) and len(set(ds["prompt"])) > 1
    assert list(ds["answer"]) == [""] * 40


@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", 42),
        ("The answer is 7.", 7),
        ("3 + 4 = 7", 7),
        ("first 12 then -5", -5),
        ("-3", -3),
        ("it is = -8!", -8),
        ("5-3", 3),
        ("1,000", 1000),
        ("total: 12,345,678 apples", 12345678),
        ("1,0000", 0),
        ("3,4", 4),
        ("abc12", 12),
        ("007", 7),
        ("no number here", None),
        ("", None),
        ("- 5", 5),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_rewards():
    assert exact_match("I think 8", "8") == 1.0
    assert exact_match("8 no 9", "8") == 0.0
    assert exact_match("nothing", "0") == 0.0
    assert exact_match("-4", "-4") == 1.0
    assert digit_share("", "") == 0.0
    assert digit_share("12ab", "") == 0.5
    assert digit_share("0123456789", "ignored") == 1.0
    assert digit_share("\u0663\u0664", "") == 0.0  # non-ASCII digits do not count


def test_registry():
    assert get_task("arithmetic") == (arithmetic_dataset, exact_match)
    assert get_task("digits") == (digits_dataset, digit_share)
    assert set(TASKS) == {"arithmetic", "digits"}
    with pytest.raises(ValueError, match=r"'nope'.*arithmetic.*digits"):
        get_task("nope")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num": 0}, "num"),
        ({"num": -3}, "num"),
        ({"num": 2.5}, "num"),
        ({"num": 5, "max_operand": 0}, "max_operand"),
        ({"num": 5, "ops": ("/",)}, "ops"),
        ({"num": 5, "ops": ("+", "^")}, "ops"),
        ({"num": 5, "ops": ()}, "ops"),
    ],
)
def test_arithmetic_bad_input(kwargs, field):
    with pytest.raises(ValueError, match=field):
        arithmetic_dataset(**kwargs)


def test_digits_bad_input():
    with pytest.raises(ValueError, match="num"):
        digits_dataset(0)
