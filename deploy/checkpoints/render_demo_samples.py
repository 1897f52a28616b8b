#!/usr/bin/env python3
"""A grid of the demo model's pictures with their prompts, rendered by the running services (README's figure).

Every picture comes from the public API through the official ``openai`` client (seed 0, 64x64), enlarged 3x
with nearest-neighbour so its pixels stay visible, and captioned with the exact prompt. The last row asks
for colour x shape pairs the model never saw in training.

    python -m deploy.checkpoints.render_demo_samples [--base-url http://127.0.0.1:8000/v1]
        [--out docs/demo_samples.png] [--steps 20]
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import textwrap
from pathlib import Path

from openai import OpenAI
from PIL import Image, ImageDraw, ImageFont

# Written as people write, in the grammar's patterns (deploy/checkpoints/prompt_grammar.py): some in patterns the
# model was never trained on (a request that names the background first, a statement that starts with the place),
# some naming no place (the quarter is then the model's to choose).
SEEN = [
    "draw a red circle on a blue background in the top left",
    "On yellow, can you draw a blue triangle in the upper right?",
    "In the lower left, there is a black box on a green background.",
    "white triangle, green background",
    "I need a simple picture: a crimson disc against a cobalt backdrop, bottom right",
    "SCARLET BALL ON BLACK",
    "golden square, top-left corner, black background",
    "please draw a green circle on white",
]
HELD_OUT = [
    "a green triangle on a white background, in the top left",
    "show me a yellow circle on blue, upper right",
    "Against yellow, paint a blue square in the lower left",
    "black background, green wedge in the bottom right",
]
SCALE = 3
COLUMNS = 4
CAPTION_LINES = 4


def render(client: OpenAI, prompt: str, steps: int) -> Image.Image:
    result = client.images.generate(
        model="ardit", prompt=prompt, size="64x64", extra_body={"seed": 0, "num_inference_steps": steps}
    )
    assert result.data and result.data[0].b64_json is not None
    return Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB")


def grid(tiles: list[tuple[str, Image.Image, bool]]) -> Image.Image:
    font = ImageFont.load_default(size=11)
    side = 64 * SCALE
    caption = 14 * CAPTION_LINES + 6
    rows = -(-len(tiles) // COLUMNS)
    sheet = Image.new("RGB", (COLUMNS * (side + 8) + 8, rows * (side + caption + 8) + 8), "white")
    pen = ImageDraw.Draw(sheet)
    for i, (prompt, image, held_out) in enumerate(tiles):
        x, y = 8 + (i % COLUMNS) * (side + 8), 8 + (i // COLUMNS) * (side + caption + 8)
        sheet.paste(image.resize((side, side), Image.Resampling.NEAREST), (x, y))
        text = textwrap.wrap(("[held out] " if held_out else "") + prompt, width=30)[:CAPTION_LINES]
        pen.multiline_text((x, y + side + 4), "\n".join(text), fill="black", font=font, spacing=2)
    return sheet


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "docs" / "demo_samples.png")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)
    tiles = [(p, render(client, p, args.steps), False) for p in SEEN]
    tiles += [(p, render(client, p, args.steps), True) for p in HELD_OUT]
    grid(tiles).save(args.out, optimize=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
