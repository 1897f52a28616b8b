#!/usr/bin/env python3
"""Build a tiny Qwen-Image-2.1, in the folder layout ``QwenImage21Pipeline`` saves.

The real one is a unified text-to-image and edit model: a Qwen3-VL text encoder that reads the prompt (and, for an
edit, the pictures), a DiT over unpatched 64-channel latents and an RGBA VAE that compresses 16x. No hub is reachable
here, so the path a user of the real model takes (``QwenImage21Pipeline.from_pretrained(folder)``) is proven on this:
seeded random weights of the real architecture, at a toy size.

- ``text_encoder/``: a ``Qwen3VLForConditionalGeneration`` (4 text layers of width 128, 2 query heads of 64 / 1 KV
  head, Qwen3's 151,936-row vocabulary, interleaved M-RoPE; a 2-block vision tower with deepstack), its norms drawn
  around 1, bf16.
- ``processor/``: a ``Qwen3VLProcessor`` (patch 16, merge 2, mean and std 0.5, as Qwen3-VL's), Qwen3's tokenizer
  files and Qwen2-VL's chat template (for the system message the pipeline measures its dropped prefix with, and for
  pictures, it renders what Qwen3-VL's does). The pipeline has no ``tokenizer/``: it tokenizes with the processor.
- ``transformer/``: ``QwenImage21Transformer2DModel`` at the text encoder's width (``context_in_dim`` 128), 2 layers,
  ``causal_condition`` as published, drawn as ``TRANSFORMER_INIT`` says (``build_qwen_image_edit`` has the reasons):
  Linear weights at std 1.2 / sqrt(fan_in), norms around 1, a timestep embedder that reads only the sinusoids bf16
  resolves. Measured with diffusers' pipeline (64x64, 3 steps, seed 11), levels of 255 mean/max: the rows with the
  final norm applied (transformers 5's ``hidden_states[-1]`` without the pipeline's hook) 1.8/18, the user turn's
  opening dropped too 1.7/21, against bf16 vs fp32 0.4/3 (with CFG 4 against " ": 0.9/6); at torch's default init
  the bf16 error was 3.0/28, larger than either mistake.
- ``vae/``: ``AutoencoderKLQwenImage21`` (RGBA in and out, 64 latent channels, 16x) at a toy width.
- ``scheduler/``: ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting, as Qwen-Image's.
- ``model_index.json``: ``QwenImage21Pipeline`` with its five parts. No ``ardit.json``: served with the family's
  own defaults (``services.model_card``).

Usage: ``python -m deploy.checkpoints.build_qwen_image_21 [--out DIR] [--seed N] [--force]``
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path
from typing import Any

from deploy.checkpoints.build_qwen3_families import QWEN3_CONFIG
from deploy.checkpoints.build_qwen_image_edit import CHAT_TEMPLATE, read_slow_sinusoids
from deploy.checkpoints.build_qwen_image_full import TOKENIZER_FILES, tokenizer_files
from deploy.checkpoints.build_tiny_qwen_image import build_once
from services.checkpoints import QWEN_IMAGE_21_MODEL, default_model_dir

RECIPE_VERSION = 1  # bump when the build changes in a way the recipe does not show

TEXT_CONFIG: dict[str, Any] = {
    **{k: v for k, v in QWEN3_CONFIG.items() if k not in ("rope_theta", "tie_word_embeddings")},
    "num_hidden_layers": 4,
    # Qwen3-VL's interleaved M-RoPE sections (24, 20, 20 at head dim 128), at head dim 64.
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [12, 10, 10],
        "mrope_interleaved": True,
    },
}
VISION_CONFIG: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "out_hidden_size": QWEN3_CONFIG["hidden_size"],
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 256,
    "deepstack_visual_indexes": [0],
    "in_channels": 3,
}
SPECIAL_TOKENS: dict[str, Any] = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": True,
}
# Qwen3-VL's preprocessor_config.json, as its image processor's arguments.
IMAGE_PROCESSOR_CONFIG: dict[str, Any] = {
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
TRANSFORMER: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": 64,
    "num_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "context_in_dim": QWEN3_CONFIG["hidden_size"],
    "mlp_ratio": 3,
    "axes_dims_rope": [8, 12, 12],
    "causal_condition": True,
}
TRANSFORMER_INIT: dict[str, Any] = {
    "linear_weight_std_times_sqrt_fan_in": 1.2,
    "norm_weights": [0.5, 1.5],  # the attention's q/k RMSNorms; the rows' zero-centred norm gets this minus 1
    "timestep_embedding_max_frequency": 0.003,  # rad per unit of t (0-1000): the sinusoids the DiT reads
}
VAE: dict[str, Any] = {
    "base_dim": 8,
    "decoder_base_dim": 8,
    "z_dim": 64,
    "dim_mult": [1, 1, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, False, False, False],
    "latents_mean": [0.0] * 64,
    "latents_std": [1.0] * 64,
    "in_channels": 4,
    "out_channels": 4,
}
SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "base_shift": 0.5,
    "max_shift": 0.9,
}


def recipe(seed: int) -> dict[str, Any]:
    return {
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "text": TEXT_CONFIG,
        "vision": VISION_CONFIG,
        "image_processor": IMAGE_PROCESSOR_CONFIG,
        "chat_template": CHAT_TEMPLATE,
        "transformer": TRANSFORMER,
        "transformer_init": TRANSFORMER_INIT,
        "vae": VAE,
        "scheduler": SCHEDULER,
    }


def text_encoder(spec: dict[str, Any]) -> Any:
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(text_config=spec["text"], vision_config=spec["vision"], **SPECIAL_TOKENS)
    torch.manual_seed(spec["seed"])
    model = Qwen3VLForConditionalGeneration(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model.bfloat16()


def transformer(spec: dict[str, Any]) -> Any:
    import torch
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Transformer2DModel

    init = spec["transformer_init"]
    torch.manual_seed(spec["seed"])
    model = QwenImage21Transformer2DModel(**spec["transformer"])
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, init["linear_weight_std_times_sqrt_fan_in"] / math.sqrt(module.in_features))
            elif isinstance(module, RMSNorm) and module.weight is not None:
                module.weight.uniform_(*init["norm_weights"])
        low, high = init["norm_weights"]
        model.txt_in.text_norm.weight.uniform_(low - 1, high - 1)
        read_slow_sinusoids(model.time_text_embed.timestep_embedder.linear_1, init["timestep_embedding_max_frequency"])
    return model.to(torch.bfloat16)


def processor(spec: dict[str, Any], tokenizer_dir: Path) -> Any:
    from transformers import Qwen2Tokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**spec["image_processor"]),
        tokenizer=Qwen2Tokenizer.from_pretrained(str(tokenizer_dir)),
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=spec["chat_template"],
    )


def build(spec: dict[str, Any], work_dir: Path, tokenizer_dir: Path) -> None:
    import torch
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage21 import AutoencoderKLQwenImage21
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import QwenImage21Pipeline
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    torch.manual_seed(spec["seed"])
    vae = AutoencoderKLQwenImage21(**spec["vae"])
    pipeline = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**spec["scheduler"]),
        vae=vae.to(torch.bfloat16),
        text_encoder=text_encoder(spec),
        processor=processor(spec, tokenizer_dir),
        transformer=transformer(spec),
    )
    pipeline.save_pretrained(str(work_dir), safe_serialization=True)
    # diffusers saved the tokenizer as transformers writes it; the published folder has Qwen's own files.
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, work_dir / "processor" / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=default_model_dir(QWEN_IMAGE_21_MODEL), help="output dir")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = ap.parse_args(argv)

    spec = recipe(args.seed)
    build_once(args.out, spec, lambda work_dir: build(spec, work_dir, tokenizer_files()), args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
