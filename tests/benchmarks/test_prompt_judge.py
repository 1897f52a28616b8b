"""benchmarks/prompt_judge.py: reads every attribute of the scene generator's own pictures correctly."""

from __future__ import annotations

import random

from PIL import Image

from benchmarks.prompt_judge import judge
from deploy.checkpoints.demo_scenes import all_attributes, draw, random_scene


def test_judge_reads_every_combination_of_clean_pictures():
    rng = random.Random(7)
    wrong = []
    for attributes in all_attributes():
        scene = random_scene(attributes, rng)
        reading = judge(draw(scene))
        asked = (attributes.shape, attributes.colour, attributes.background, attributes.row, attributes.column)
        if (reading.shape, reading.colour, reading.background, reading.row, reading.column) != asked:
            wrong.append((scene, reading))
    assert wrong == []


def test_a_plain_picture_has_no_shape():
    reading = judge(Image.new("RGB", (64, 64), (30, 60, 220)))
    assert reading.background == "blue" and reading.shape is None and reading.row is None
