"""FLUX.2 [klein]'s pad rows: what a causal engine can give its DiT instead of the reference's, and how far each
is from diffusers' own pipeline, in conditioning and in pictures.

``Flux2KleinPipeline`` tokenizes a prompt padded to ``max_sequence_length`` (512) and runs its Qwen3 text encoder
under the padding mask: each pad row attends to the real tokens only, at its own position. Its DiT then attends
over all 512 rows, pads included (no mask). A causal engine (vLLM) computes a token's row from every token before
it, in sequence, so it can give either

- ``causal prefill of the pads``: the same 512 ids prefilled, each pad also attending to the pads before it; or
- ``real rows only``: the prompt's own rows, no pads, the DiT given those.

The real rows are equal in all three by causality (measured here too). This runs the reference, builds both
alternatives from the same text encoder with transformers, and renders all three with the same seed.

    python benchmarks/flux2_pad_rows.py [--model DIR] [--steps 4] [--size 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import paired
import torch
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

LAYERS = (9, 18, 27)  # the pipeline's default text_encoder_out_layers
MAX_ROWS = 512  # its default max_sequence_length
PROMPTS = [
    "a red fox in the snow",
    "an old lighthouse on a cliff at dusk, oil painting, warm light",
    "In the style of a late nineteenth century oil painting on heavy linen canvas, with thick impasto brushwork, "
    "a bowl of pears on a wooden table by a window",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("~/.cache/ardit/models/flux2-klein-tiny"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=paired.RESULTS / "flux2_pad_rows.json")
    args = parser.parse_args()
    pipe = Flux2KleinPipeline.from_pretrained(str(args.model.expanduser()), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def render(embeds: torch.Tensor, seed: int) -> np.ndarray:
        image = pipe(
            prompt_embeds=embeds,
            width=args.size,
            height=args.size,
            num_inference_steps=args.steps,
            guidance_scale=1.0,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
        ).images[0]
        return np.asarray(image, dtype=np.float64)

    report: dict = {
        "command": "python benchmarks/flux2_pad_rows.py " + " ".join(sys.argv[1:]),
        "machine": paired.machine(),
        "model": str(args.model),
        "prompts": {},
    }
    for prompt in PROMPTS:
        text = pipe.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        ids = pipe.tokenizer(text, return_tensors="pt", padding="max_length", max_length=MAX_ROWS, truncation=True)
        real = int(ids.attention_mask.sum())
        with torch.inference_mode():
            reference, _ = pipe.encode_prompt(prompt=prompt, device=torch.device("cpu"), max_sequence_length=MAX_ROWS)
            hidden = pipe.text_encoder(input_ids=ids.input_ids, output_hidden_states=True, use_cache=False)
            causal = torch.cat([hidden.hidden_states[k] for k in LAYERS], dim=-1)
        alternatives = {"causal prefill of the pads": causal, "real rows only": reference[:, :real]}
        pictures: dict[str, dict[str, float]] = {}
        for name, embeds in alternatives.items():
            differences = [np.abs(render(embeds, seed) - render(reference, seed)) * 255 for seed in range(args.seeds)]
            pictures[name] = {
                "max_over_255": round(float(max(d.max() for d in differences)), 2),
                "mean_over_255": round(float(np.mean([d.mean() for d in differences])), 3),
            }
        report["prompts"][prompt] = {
            "real_rows": real,
            "real_rows_causal_vs_reference_max": float((causal[:, :real] - reference[:, :real]).abs().max()),
            "pad_rows_causal_vs_reference_max": float((causal[:, real:] - reference[:, real:]).abs().max()),
            "pad_rows_reference_scale": float(reference[:, real:].abs().max()),
            "pictures_vs_reference": pictures,
        }
        print(json.dumps({prompt[:40]: report["prompts"][prompt]}), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
