"""Digit-string tasks: copy / reverse / sort a short string of digits.

Made for CPU demos: a randomly initialised 2-layer model learns ``copy`` by GRPO alone in minutes,
because the answer is a few single-digit tokens and the scorer gives partial credit per position
(see megatron_rl/reward/scorers/digits.py). ``reverse`` and ``sort`` are harder variants.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

__all__ = ["DIGIT_OPS", "make_digit_rows"]

DIGIT_OPS: dict[str, Callable[[str], str]] = {
    "copy": lambda digits: digits,
    "reverse": lambda digits: digits[::-1],
    "sort": lambda digits: "".join(sorted(digits)),
}


def make_digit_rows(
    op: str, n: int, rng: random.Random, split: str, min_digits: int = 3, max_digits: int = 5
) -> list[dict[str, Any]]:
    """``n`` verl-format rows; the prompt is ``"<op>: <digits>"``, the ground truth the transformed string."""
    transform = DIGIT_OPS[op]
    rows = []
    for index in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))
        rows.append(
            {
                "data_source": f"synthetic/{op}",
                "prompt": [{"role": "user", "content": f"{op}: {digits}"}],
                "ability": "digits",
                "reward_model": {"style": "rule", "ground_truth": transform(digits)},
                "extra_info": {"split": split, "index": index, "digits": digits},
            }
        )
    return rows
