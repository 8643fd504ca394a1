"""Small arithmetic word problems in GSM8K's format: a worked solution ending in ``#### <answer>``.

Rows look like verl's GSM8K preprocessing: the prompt asks for the answer after "####", the ground
truth is the bare number, and ``extra_info.answer`` holds the worked solution (usable for SFT warm-up).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

__all__ = ["INSTRUCTION", "make_arithmetic_rows"]

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_NAMES = ("Ana", "Ben", "Mia", "Tom", "Lea", "Sam")
_ITEMS = ("apples", "pens", "cards", "stamps", "books", "shells")

# Each problem: (question, worked solution, answer) from a name, an item and a random source.
Problem = tuple[str, str, int]


def _more(name: str, item: str, rng: random.Random) -> Problem:
    a, b = rng.randint(2, 50), rng.randint(2, 50)
    return (
        f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?",
        f"{name} has {a} + {b} = {a + b} {item}.",
        a + b,
    )


def _left(name: str, item: str, rng: random.Random) -> Problem:
    a = rng.randint(10, 90)
    b = rng.randint(1, a - 1)
    return (
        f"{name} has {a} {item} and gives {b} of them away. How many {item} are left?",
        f"{name} has {a} - {b} = {a - b} {item} left.",
        a - b,
    )


def _boxes(name: str, item: str, rng: random.Random) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    return (
        f"{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?",
        f"{name} buys {a} * {b} = {a * b} {item}.",
        a * b,
    )


def _two_step(name: str, item: str, rng: random.Random) -> Problem:
    a, b, c = rng.randint(1, 20), rng.randint(2, 6), rng.randint(2, 10)
    d = rng.randint(1, a + b * c - 1)
    total = a + b * c
    return (
        f"{name} has {a} {item}, buys {b} packs of {c} {item} and then gives away {d}. "
        f"How many {item} does {name} have?",
        f"The packs hold {b} * {c} = {b * c} {item}, so {name} has {a} + {b * c} = {total}. "
        f"After giving away {d}, {name} has {total} - {d} = {total - d}.",
        total - d,
    )


_TEMPLATES: tuple[Callable[[str, str, random.Random], Problem], ...] = (_more, _left, _boxes, _two_step)


def make_arithmetic_rows(n: int, rng: random.Random, split: str) -> list[dict[str, Any]]:
    """``n`` verl-format GSM8K-style rows (``data_source="synthetic/arith"``, scored like GSM8K)."""
    rows = []
    for index in range(n):
        question, solution, answer = rng.choice(_TEMPLATES)(rng.choice(_NAMES), rng.choice(_ITEMS), rng)
        rows.append(
            {
                "data_source": "synthetic/arith",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "question": question,
                    "answer": f"{solution}\n#### {answer}",
                },
            }
        )
    return rows
