"""Procedural prompts for distillation: templates x topics x tasks, no downloads.

Prompts come in kinds (questions, explanations, lists, stories, instructions, code, arithmetic word
problems). Held-out prompts come from templates the training split never uses (each kind's last one),
filled from a different seed, so held-out acceptance measures a draft on prompts it never saw the form of.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

_NAMES = ["Tom", "Maria", "Aisha", "Kenji", "Liam", "Sofia", "Omar", "Mei", "Noah", "Priya", "Lucas", "Zara",
          "Ivan", "Chloe", "Mateo", "Hana", "Ben", "Fatima", "Leo", "Nina"]
_ITEMS = ["apples", "pencils", "marbles", "books", "stickers", "cookies", "coins", "cards", "flowers", "eggs",
          "oranges", "toy cars", "shells", "balloons", "cupcakes", "stamps"]
_TOPICS = ["photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
           "climate change", "the human heart", "volcanoes", "the stock market", "vaccines", "electricity",
           "the Roman Empire", "DNA", "gravity", "the internet", "recycling", "honey bees", "the moon",
           "inflation", "sleep", "rainbows", "earthquakes", "democracy", "chess", "coffee", "glaciers",
           "the immune system", "solar panels", "bread baking", "music theory", "the printing press",
           "ocean tides", "friendship", "time management", "public speaking", "exercise", "dinosaurs"]
_THINGS = ["a cat", "a robot", "a lighthouse keeper", "a young wizard", "a lost dog", "an astronaut",
           "a baker", "a dragon", "a detective", "a tree", "a little girl", "an old fisherman", "a pirate",
           "a teacher", "a talking car", "a penguin"]
_CODE_TASKS = ["reverses a string", "checks whether a number is prime", "sorts a list of numbers",
               "counts the vowels in a sentence", "computes the factorial of n", "finds the largest element "
               "in a list", "converts Celsius to Fahrenheit", "checks if a word is a palindrome",
               "sums the digits of an integer", "returns the Fibonacci numbers up to n",
               "removes duplicates from a list", "counts word frequencies in a text"]
_LANGS = ["Python", "JavaScript", "C", "Java", "Rust", "Go"]

# Templates per kind; the LAST template of each kind is held out (never used for training prompts).
_TEMPLATES = {
    "question": ["What is {topic}?", "Why is {topic} important?", "How does {topic} work?",
                 "What are the main facts about {topic}?", "Can you tell me something surprising about {topic}?"],
    "explain": ["Explain {topic} in simple terms.", "Explain {topic} to a ten-year-old.",
                "Give a short explanation of {topic}.", "Describe {topic} in three sentences.",
                "Summarize what everyone should know about {topic}."],
    "list": ["List five facts about {topic}.", "Give me three tips related to {topic}.",
             "Name four common misconceptions about {topic}.", "List the pros and cons of {topic}.",
             "What are three questions a student might ask about {topic}?"],
    "story": ["Write a short story about {thing}.", "Tell a bedtime story about {thing}.",
              "Write a poem about {thing}.", "Write a funny story about {thing} and {thing2}.",
              "Write a short fable about {thing} that teaches a lesson."],
    "instruction": ["Write an email to a friend about {topic}.", "Write a short speech about {topic}.",
                    "Give me a step-by-step guide to learning about {topic}.",
                    "Write a tweet about {topic}.", "Write a short blog post introduction about {topic}."],
    "code": ["Write a {lang} function that {code}.", "Show me {lang} code that {code}.",
             "How do I write a program in {lang} that {code}?", "Write a short {lang} snippet that {code}.",
             "Implement a function in {lang} which {code}, and explain it."],
    "math": ["{name} has {a} {item}. {name2} gives {name} {b} more. How many {item} does {name} have now?",
             "{name} had {a} {item} and gave away {b}. How many {item} are left?",
             "There are {a} boxes with {b} {item} in each box. How many {item} are there in total?",
             "{name} shares {c} {item} equally among {d} friends. How many {item} does each friend get?",
             "{name} buys {a} {item} at {d} dollars each and pays with a {e}-dollar bill. How much change "
             "does {name} get?"],
}


@dataclass(frozen=True)
class PromptSplit:
    train: list[str]
    heldout: list[str]


def _fill(template: str, rng: random.Random) -> str:
    name, name2 = rng.sample(_NAMES, 2)
    thing, thing2 = rng.sample(_THINGS, 2)
    d = rng.randint(2, 9)
    return template.format(topic=rng.choice(_TOPICS), thing=thing, thing2=thing2, code=rng.choice(_CODE_TASKS),
                           lang=rng.choice(_LANGS), name=name, name2=name2, item=rng.choice(_ITEMS),
                           a=rng.randint(2, 60), b=rng.randint(2, 30), c=d * rng.randint(2, 12), d=d,
                           e=rng.choice([20, 50, 100]))


def distinct_in_rotation(count: int, templates: dict[str, list[str]], pick: Callable[[list[str], random.Random], str],
                         fill: Callable[[str, random.Random], str], rng: random.Random) -> list[str]:
    """Up to `count` distinct prompts, the kinds of `templates` taking turns: each try fills
    (`fill`) the template `pick` takes from its kind's list; at most 50 * count + 100 tries."""
    out: list[str] = []
    seen: set[str] = set()
    kinds = list(templates)
    attempts = 0
    while len(out) < count and attempts < 50 * count + 100:
        kind = kinds[attempts % len(kinds)]
        attempts += 1
        text = fill(pick(templates[kind], rng), rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def build_prompts(num_train: int, num_heldout: int, seed: int = 0) -> PromptSplit:
    """Varied instruction prompts, kinds in rotation (questions, explanations, lists, stories,
    instructions, code, arithmetic word problems). Held-out prompts use each kind's last template,
    which training never uses, and a different seed; duplicates are removed."""
    return PromptSplit(
        train=distinct_in_rotation(num_train, _TEMPLATES, lambda ts, rng: rng.choice(ts[:-1]), _fill, random.Random(seed)),
        heldout=distinct_in_rotation(num_heldout, _TEMPLATES, lambda ts, rng: ts[-1], _fill,
                                     random.Random(seed + 1_000_003)))


# The two held-out sets the benches and bench/eval_draft.py measure drafts on (bench/common.bench_prompts):
# "templates", the recipe's held-out prompts (templates training never uses), and "unseen", training
# prompts UNSEEN_FROM.. of a UNSEEN_OF-prompt set, which no data cache of the default draft sampled
EVAL_SETS = ("templates", "unseen")
UNSEEN_FROM, UNSEEN_OF = 7900, 8000


def eval_texts(prompt_set: str, count: int) -> list[str]:
    """The first `count` prompts of an evaluation set (`EVAL_SETS`), as text."""
    if prompt_set == "templates":
        texts = build_prompts(UNSEEN_OF, count, seed=0).heldout
    elif prompt_set == "unseen":
        texts = build_prompts(UNSEEN_OF, 0, seed=0).train[UNSEEN_FROM:]
    else:
        raise ValueError(f"prompt set must be one of {EVAL_SETS}, got {prompt_set!r}")
    if count > len(texts):
        raise ValueError(f"prompt set {prompt_set!r} holds {len(texts)} prompts, {count} asked")
    return texts[:count]


def chat_prompt_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text as a single user turn with the generation prompt (engine's chat=True)."""
    out = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out
