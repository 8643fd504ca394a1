"""``shapes``: count the squares in a picture — a vision task in verl's geo3k row format, made locally.

Each picture is 56x56 pixels, white, split into four 28x28 quarters; 1 to 4 of them (chosen at random) hold
one filled square of a single random colour. A quarter is exactly one merged patch of a Qwen2.5-VL vision
tower (patch 14, merge 2), so a tiny random model sees the count as which of its 4 image tokens are coloured:
learnable by RL on a CPU. Rows carry the PNG in ``images`` as ``[{"bytes": ...}]`` with one ``<image>`` in
the prompt (verl's multimodal format), ``data_source="synthetic/shapes"`` and the count as ground truth,
scored by megatron_rl.reward.scorers.shapes.
"""

from __future__ import annotations

import random
from io import BytesIO
from typing import Any

from PIL import Image, ImageDraw

__all__ = ["COLOUR_DATA_SOURCE", "COLOUR_NAMES", "DATA_SOURCE", "IMAGE_SIZE", "INSTRUCTION", "QUESTION", "draw_squares", "make_colour_rows",
           "make_shapes_rows"]

DATA_SOURCE = "synthetic/shapes"
COLOUR_DATA_SOURCE = "synthetic/shape_colour"
IMAGE_SIZE = 56
QUESTION = "<image>How many squares are in the picture?"
INSTRUCTION = "Answer with a single digit."  # geo3k's layout: question, then the answer format
# several colours: a count must not depend on the colour (a single-colour variant was no easier for RL: see the
# vision demo in docs/quickstart.md)
_COLOURS = ((220, 20, 60), (30, 144, 255), (34, 139, 34), (255, 140, 0), (148, 0, 211))
# shape_colour: which of four colours one square has (the number before it in the question is the answer)
COLOUR_NAMES = {"1": ("red", (220, 20, 60)), "2": ("green", (34, 139, 34)), "3": ("blue", (30, 144, 255)),
                "4": ("black", (0, 0, 0))}
COLOUR_QUESTION = "<image>What colour is the square? " + ", ".join(
    f"{number} {name}" for number, (name, _) in COLOUR_NAMES.items()) + "."
_QUARTER = IMAGE_SIZE // 2


def draw_squares(quarters: list[int], colour: tuple[int, int, int], rng: random.Random) -> bytes:
    """A PNG with one filled square (side 22-28 pixels: most of the quarter, placed at random) in each of the given quarters (0-3)."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for quarter in quarters:
        side = rng.randint(22, 28)
        left = (quarter % 2) * _QUARTER + rng.randint(0, _QUARTER - side)
        top = (quarter // 2) * _QUARTER + rng.randint(0, _QUARTER - side)
        draw.rectangle((left, top, left + side - 1, top + side - 1), fill=colour)
    out = BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def make_shapes_rows(n: int, rng: random.Random, split: str) -> list[dict[str, Any]]:
    """``n`` verl-format rows: one picture of 1-4 squares each; the ground truth is the count as a digit."""
    rows = []
    for index in range(n):
        count = rng.randint(1, 4)
        quarters = sorted(rng.sample(range(4), count))
        png = draw_squares(quarters, rng.choice(_COLOURS), rng)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{QUESTION} {INSTRUCTION}"}],
                "images": [{"bytes": png}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": str(count)},
                "extra_info": {"split": split, "index": index, "answer": str(count), "question": QUESTION},
            }
        )
    return rows


def make_colour_rows(n: int, rng: random.Random, split: str) -> list[dict[str, Any]]:
    """``n`` rows of ``shape_colour``: a 28 x 28 picture (one merged patch: one image token) with one filled square
    of side 16-28 of one of four colours; the ground truth is the colour's number in the question."""
    rows = []
    for index in range(n):
        answer = rng.choice(sorted(COLOUR_NAMES))
        image = Image.new("RGB", (_QUARTER, _QUARTER), (255, 255, 255))
        side = rng.randint(16, _QUARTER)
        left, top = rng.randint(0, _QUARTER - side), rng.randint(0, _QUARTER - side)
        ImageDraw.Draw(image).rectangle((left, top, left + side - 1, top + side - 1), fill=COLOUR_NAMES[answer][1])
        out = BytesIO()
        image.save(out, format="PNG")
        rows.append(
            {
                "data_source": COLOUR_DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{COLOUR_QUESTION} {INSTRUCTION}"}],
                "images": [{"bytes": out.getvalue()}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "answer": answer, "question": COLOUR_QUESTION},
            }
        )
    return rows
