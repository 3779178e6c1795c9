"""More kinds of procedural prompts for distillation, apart from `prompts.build_prompts`' templates.

A draft distilled on `build_prompts`' training templates accepts far more on new prompts of those
templates than on the held-out ones (each kind's last template): it learns the forms of answer it saw.
These templates add forms (comparisons, rewrites, plans, dialogues, advice, debugging, conversions,
definitions, brainstorms, and more) over their own vocabulary, so that a draft meets many kinds of
request. None is a held-out template of `build_prompts` nor a rewording of one (no fables, blog-post
openings, "surprising" facts, student questions, "implement and explain" code or change-making sums),
so the recipe's held-out acceptance still measures prompts of forms the draft never trained on (a few
ask for a topic in brief, as `build_prompts`' own training templates "Give a short explanation of" and
"Describe ... in three sentences" do beside the held-out "Summarize what everyone should know about").
`build_prompts` itself is left as it was: the benches' prompt sets are defined from it.
"""

from __future__ import annotations

import random
from typing import Sequence

from rollout_ssd.draft.prompts import distinct_in_rotation

_SUBJECTS = ["rivers", "smartphones", "the solar system", "ancient Egypt", "renewable energy", "bacteria",
             "the Olympic Games", "money", "languages", "bridges", "forests", "airplanes", "the brain",
             "volunteering", "video games", "pollution", "robots", "nutrition", "deserts", "photography",
             "the Great Wall of China", "magnets", "whales", "cloud computing", "poetry", "traffic",
             "spiders", "batteries", "board games", "the ocean floor", "mountains", "social media",
             "vitamins", "the Renaissance", "weather forecasts", "trains", "gardening", "owls",
             "cryptography", "the Amazon rainforest", "jazz", "microscopes", "taxes", "yoga"]
_PAIRS = [("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("books", "movies"), ("summer", "winter"),
          ("Python", "JavaScript"), ("renting", "buying a home"), ("solar power", "wind power"),
          ("running", "swimming"), ("email", "phone calls"), ("cities", "the countryside"),
          ("paper books", "e-readers"), ("viruses", "bacteria"), ("weather", "climate"), ("lists", "tuples"),
          ("mitosis", "meiosis"), ("stocks", "bonds"), ("the sun", "the moon"), ("frogs", "toads"),
          ("SQL", "NoSQL databases")]
_PEOPLE = ["a chef", "a nurse", "a farmer", "a librarian", "a firefighter", "a student", "a grandmother",
           "a programmer", "a painter", "a shop owner", "a scientist", "a bus driver", "a musician",
           "a gardener", "a soldier", "a tourist"]
_PLACES = ["a busy market", "a quiet library", "a space station", "a snowy village", "a desert island",
           "an old castle", "a train station", "a hospital at night", "a city park", "a submarine",
           "a mountain cabin", "a school playground"]
_GOALS = ["sleep better", "save money", "learn a new language", "get fit", "make new friends",
          "study for an exam", "start a small business", "read more books", "eat healthier", "waste less food",
          "keep a tidy room", "prepare for a job interview", "learn to cook", "reduce stress"]
_SENTENCES = ["me and him goes to the store yesterday", "the meeting have been moved to friday",
              "I can not believe how fast the time past", "their going to they're house later",
              "she dont like apples but she like oranges", "we was happy with the result of the test",
              "the weather is nice today so we goes outside", "he have three brother and one sister"]
_WORDS = ["resilient", "ambiguous", "gratitude", "curious", "ephemeral", "meticulous", "habitat", "velocity",
          "empathy", "algorithm", "metaphor", "erosion", "budget", "symbiosis", "perspective", "catalyst"]
_CODE_BUGS = ["for i in range(len(xs)): total += xs[i+1]", "if x = 5: print('five')",
              "def add(a, b): return a - b", "while n > 0: print(n)", "items = [1, 2, 3]; print(items[3])",
              "name = input('Name: ') ; print('Hello ' + nam)"]
_CODE_ASKS = ["reads a text file and prints its longest line", "merges two sorted lists",
              "validates an email address", "counts the lines in a file", "finds the second largest number",
              "capitalises the first letter of each word", "shuffles a deck of cards", "checks for balanced brackets",
              "converts a number to binary", "groups words by their first letter", "computes an average grade",
              "finds common elements of two lists"]
_LANGS = ["Python", "JavaScript", "C++", "Ruby", "TypeScript", "Bash", "SQL", "Kotlin"]
_FOODS = ["pancakes", "a vegetable soup", "fried rice", "a fruit salad", "banana bread", "tomato pasta",
          "guacamole", "lemonade", "an omelette", "oatmeal cookies"]
_CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Toronto", "Rome", "Seoul", "Nairobi", "Sydney", "Lisbon"]

_TEMPLATES = {
    "compare": ["Compare {x} and {y}.", "What is the difference between {x} and {y}?",
                "Which is better, {x} or {y}? Give reasons for both sides.",
                "Make a table comparing {x} and {y}."],
    "howto": ["How can I {goal}?", "What is a simple daily routine to {goal}?",
              "I want to {goal}. Where should I start?", "Give me a one-week plan to {goal}."],
    "rewrite": ["Fix the grammar in this sentence: \"{sentence}\"", "Rewrite this more formally: \"{sentence}\"",
                "Correct the spelling and grammar: {sentence}", "Make this sentence clearer: \"{sentence}\""],
    "define": ["What does the word \"{word}\" mean? Use it in a sentence.", "Define {word}.",
               "Give three synonyms for \"{word}\".", "Explain the word \"{word}\" with an example."],
    "creative": ["Write a haiku about {subject}.", "Write a limerick about {person}.",
                 "Write a dialogue between {person} and {person2} in {place}.",
                 "Describe {place} using all five senses.", "Write a diary entry from {person} visiting {place}.",
                 "Write a song chorus about {subject}."],
    "roleplay": ["Pretend you are {person}. Describe your typical day.",
                 "You are a tour guide in {city}. Welcome a group of visitors.",
                 "Act as a teacher and give a short lesson on {subject}.",
                 "Imagine you are {person} who just discovered {subject}. What do you think?"],
    "opinion": ["What are the arguments for and against {subject}?", "Is {subject} overrated? Explain.",
                "Give your opinion on {subject} in one paragraph.",
                "What would the world be like without {subject}?"],
    "plan": ["Plan a three-day trip to {city}.", "Write a recipe for {food}.", "Give me a shopping list for {food}.",
             "Plan a birthday party for {person}.", "Make a study schedule for learning about {subject}."],
    "debug": ["What is wrong with this code? {bug}", "Find the bug: {bug}",
              "Explain why this line fails and fix it: {bug}"],
    "code": ["Write {lang} code that {ask}.", "Give an example in {lang} of a function that {ask}.",
             "Using {lang}, write a small program that {ask}.", "What is the shortest {lang} code that {ask}?"],
    "math": ["A train travels {a} km in {d} hours. What is its average speed?",
             "What is {p} percent of {b0}?", "A rectangle is {a} cm long and {d} cm wide. What is its area?",
             "Convert {a} kilometers to meters.", "If {name} reads {d} pages a day, how many pages in {b} days?",
             "What is {a} times {d}, minus {b}?", "Simplify the fraction {c}/{big}."],
    "brainstorm": ["Give me ten name ideas for a shop that sells {subject}.",
                   "Brainstorm five ideas for a school project on {subject}.",
                   "Suggest three fun activities to do in {place}.", "List some gift ideas for {person}."],
    "trivia": ["What jobs involve {subject}?", "Who first studied {subject}, and when?",
               "How has {subject} changed over the last hundred years?",
               "What is the history of {subject} in brief?"],
    "summarize": ["Summarize the life of {person} in {city} in a few sentences.",
                  "In one sentence, what is {subject} about?", "Explain the role of {subject} in everyday life.",
                  "Explain {subject} using an analogy."],
}
_NAMES = ["Ada", "Bruno", "Carmen", "Dev", "Elif", "Finn", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Luca"]


def _fill(template: str, rng: random.Random) -> str:
    x, y = rng.choice(_PAIRS)
    person, person2 = rng.sample(_PEOPLE, 2)
    d = rng.randint(2, 9)
    c = d * rng.randint(2, 9)
    return template.format(x=x, y=y, subject=rng.choice(_SUBJECTS), person=person, person2=person2,
                           place=rng.choice(_PLACES), goal=rng.choice(_GOALS), sentence=rng.choice(_SENTENCES),
                           word=rng.choice(_WORDS), bug=rng.choice(_CODE_BUGS), ask=rng.choice(_CODE_ASKS),
                           lang=rng.choice(_LANGS), food=rng.choice(_FOODS), city=rng.choice(_CITIES),
                           name=rng.choice(_NAMES), a=rng.randint(10, 400), b=rng.randint(2, 30), d=d, c=c,
                           big=c * rng.randint(2, 6), p=rng.choice([5, 10, 15, 20, 25, 50, 75]),
                           b0=rng.choice([40, 80, 120, 200, 360, 500, 1000]))


def build_varied_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct prompts from these templates, kinds in rotation (fewer where the templates'
    fillings run out)."""
    return distinct_in_rotation(count, _TEMPLATES, lambda ts, rng: rng.choice(ts), _fill, random.Random(seed))


def interleave(varied: Sequence[str], originals: Sequence[str]) -> list[str]:
    """One varied prompt, then one original, in turn, until either runs out (then the rest of the other)."""
    out: list[str] = []
    for i in range(max(len(varied), len(originals))):
        out.extend(seq[i] for seq in (varied, originals) if i < len(seq))
    return out
