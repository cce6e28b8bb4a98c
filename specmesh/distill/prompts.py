"""Chat prompts for distillation, built offline from templates x topics, split by topic.

The held-out split shares no topic with the training split, so evaluation measures prompts the
drafter never saw (not just unseen phrasings). The split is a pure function of the topic string
(a hash), so it is stable across runs and machines.
"""

from __future__ import annotations

import hashlib
import random

TOPICS = """
photosynthesis|black holes|the water cycle|volcanoes|earthquakes|climate change|renewable energy|solar panels|
wind turbines|electric cars|batteries|the internet|email|cryptography|passwords|machine learning|neural networks|
databases|spreadsheets|version control|open source software|cloud computing|smartphones|GPS|satellites|the moon|
Mars|the solar system|stars|galaxies|gravity|magnets|electricity|light|sound|music theory|the piano|the guitar|
jazz|painting|photography|film making|poetry|novels|Shakespeare|ancient Rome|ancient Egypt|the Renaissance|
the Industrial Revolution|democracy|elections|taxes|inflation|banks|saving money|budgeting|investing|
starting a business|marketing|job interviews|writing a resume|public speaking|time management|productivity|
sleep|exercise|running|yoga|nutrition|vegetables|coffee|tea|baking bread|cooking pasta|making soup|chocolate|
gardening|houseplants|composting|bees|birds|dogs|cats|horses|whales|sharks|forests|deserts|oceans|rivers|
mountains|glaciers|weather|hurricanes|recycling|plastic pollution|cities|public transport|bicycles|trains|
airplanes|ships|bridges|skyscrapers|architecture|robots|3D printing|chess|football|basketball|tennis|the Olympics|
video games|board games|friendship|kindness|learning a language|reading habits|libraries|museums|travel|camping|
hiking|maps|history of writing|the printing press|telescopes|microscopes|vaccines|the immune system|the heart|
the brain|memory|dreams|happiness|stress|meditation|teamwork|leadership|negotiation|customer service|
remote work|online privacy|social media|news literacy|critical thinking|mathematics|prime numbers|probability|
statistics|geometry|algebra|fractions|sorting algorithms|recursion|linked lists|hash tables|binary search|
regular expressions|HTTP|JSON|SQL|Python lists|Python dictionaries|Python classes|unit testing|debugging|
command line basics|Linux|file systems|computer memory|CPUs|compilers|web browsers|HTML|CSS|JavaScript|APIs|
dinosaurs|evolution|DNA|cells|bacteria|viruses|chemistry|atoms|acids and bases|rainbows|snow|autumn|spring|
birthdays|holidays|weddings|moving to a new city|first day at school|homework|exams|teachers|parenting|
volunteering|charity|art museums|sculpture|dance|theatre|comedy|fairy tales|myths|superheroes|detective stories|
""".replace("\n", "").split("|")

CODE_TASKS = """
reverses a string|checks whether a number is prime|computes the factorial of n|returns the n-th Fibonacci number|
counts the words in a sentence|removes duplicates from a list|finds the largest element of a list|
merges two sorted lists|checks whether a string is a palindrome|converts Celsius to Fahrenheit|
reads a text file and counts its lines|flattens a nested list|computes the average of a list of numbers|
sorts a list of dictionaries by a key|finds the most common element in a list|validates an email address|
computes the greatest common divisor of two numbers|generates all permutations of a list|
implements binary search|implements bubble sort|parses a date string|sums the digits of an integer|
capitalizes every word in a sentence|counts vowels in a string|checks whether two strings are anagrams|
returns the intersection of two lists|converts a list of pairs to a dictionary|groups words by their first letter|
computes the power set of a set|implements a simple stack class|implements a queue with two stacks|
finds the second largest number in a list|rotates a list by k positions|checks balanced parentheses|
""".replace("\n", "").split("|")

TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}? Answer in a short paragraph.",
    "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.",
    "Write a short story that involves {t}.",
    "List five tips related to {t}.",
    "Why is {t} important?",
    "How would you explain {t} to a child?",
    "Write a short blog post introduction about {t}.",
    "What are the pros and cons of {t}?",
    "Describe the history of {t} briefly.",
    "Write a friendly email to a colleague about {t}.",
    "What are common misconceptions about {t}?",
    "Give a step-by-step guide to getting started with {t}.",
    "Summarize the key ideas of {t} in bullet points.",
]

CODE_TEMPLATES = [
    "Write a Python function that {t}.",
    "Write a Python function that {t}. Include a docstring and an example.",
    "How do I write code in Python that {t}? Explain briefly.",
    "Write a JavaScript function that {t}.",
]


def is_heldout(topic: str, fraction: float = 0.1) -> bool:
    h = int.from_bytes(hashlib.sha256(topic.encode()).digest()[:4], "big")
    return h / 2**32 < fraction


def prompts(split: str, heldout_fraction: float = 0.1, seed: int = 0) -> list[str]:
    """All prompts of one split ("train" or "heldout"), shuffled deterministically."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split: expected 'train' or 'heldout', got {split!r}")
    want = split == "heldout"
    out = []
    for topics, templates in ((TOPICS, TEMPLATES), (CODE_TASKS, CODE_TEMPLATES)):
        for t in topics:
            t = t.strip()
            if t and is_heldout(t, heldout_fraction) == want:
                out.extend(tpl.format(t=t) for tpl in templates)
    random.Random(seed).shuffle(out)
    return out
