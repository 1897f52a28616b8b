#!/usr/bin/env python3
"""Build a tiny, randomly initialised Qwen-Image pipeline directory for the DiT service.

No trained diffusion weights ship on PyPI and no model hub is reachable, so local runs and tests use
a Qwen-Image of the real architecture (``QwenImageTransformer2DModel`` + ``AutoencoderKLQwenImage`` +
``FlowMatchEulerDiscreteScheduler`` with Qwen-Image's scheduler config) at a toy size. **Its images are
noise**; its plumbing is the real one. Production points ``ARDIT_DIT_MODEL_DIR`` at a real Qwen-Image
checkpoint directory instead, loaded the same way::

    QwenImagePipeline.from_pretrained(dir, text_encoder=None, tokenizer=None)

The transformer's ``joint_attention_dim`` must equal the AR model's hidden size, because the DiT is
conditioned on the AR model's hidden states: it is read from ``--ar-model DIR/config.json``
(``hidden_size``), or given with ``--joint-attention-dim``; the default, 576, is SmolLM2-135M's width.

Weights are a pure function of ``--seed`` and the config (``torch.manual_seed`` before each model is
built). The build is idempotent (a ``.complete`` marker holding the config hash is written last; a
directory whose marker matches is left alone) and atomic (built in a temp dir, then renamed).

Usage::

    python deploy/checkpoints/build_tiny_qwen_image.py [--out DIR] [--ar-model DIR]
        [--joint-attention-dim N] [--seed N] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from services.checkpoints import PLUMBING_DIT_MODEL, default_model_dir, install

MARKER = ".complete"
RECIPE_VERSION = 1  # bump when the build recipe changes in a way the config hash does not show
DEFAULT_JOINT_ATTENTION_DIM = 576  # SmolLM2-135M hidden size

# 2 heads x 32 dims; the three RoPE axes (frame, height, width) must sum to the head dim.
TRANSFORMER_CONFIG = {
    "patch_size": 2,
    "in_channels": 64,  # z_dim 16 x 2x2 packed patch
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "guidance_embeds": False,
    "axes_dims_rope": [8, 12, 12],
}

# Same topology as Qwen-Image's VAE (8x spatial compression, 16 latent channels), narrow channels.
VAE_CONFIG = {
    "base_dim": 16,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
}

# Qwen/Qwen-Image scheduler_config.json: dynamic (resolution-dependent) shifting, as QwenImagePipeline expects.
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

# A randomly initialised VAE decoder outputs pixels within a few percent of mid-grey, so its images
# look flat. Amplifying its last convolution spreads them over the whole range (a few percent clip),
# which makes the noise visible and differences between outputs easy to see.
VAE_OUTPUT_GAIN = 3.0


def joint_attention_dim_of(ar_model_dir: Path) -> int:
    config = json.loads((ar_model_dir / "config.json").read_text())
    hidden = config.get("hidden_size")
    if not isinstance(hidden, int) or hidden <= 0:
        raise SystemExit(f"{ar_model_dir}/config.json has no usable hidden_size ({hidden!r})")
    return hidden


def build_recipe(joint_attention_dim: int, seed: int) -> dict:
    return {
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "transformer": {**TRANSFORMER_CONFIG, "joint_attention_dim": joint_attention_dim},
        "vae": VAE_CONFIG,
        "vae_output_gain": VAE_OUTPUT_GAIN,
        "scheduler": SCHEDULER_CONFIG,
    }


def recipe_hash(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def is_complete(out_dir: Path, config_hash: str) -> bool:
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("config_sha256") == config_hash


def build(recipe: dict, work_dir: Path) -> None:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    # From their own modules: to a type checker diffusers' top-level model and pipeline names are its
    # no-torch placeholder classes, which have neither the VAE's ``decoder`` nor ``save_pretrained``.
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

    seed = recipe["seed"]
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**recipe["transformer"])
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(**recipe["vae"])
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(recipe["vae_output_gain"])
        vae.decoder.conv_out.bias.zero_()
    scheduler = FlowMatchEulerDiscreteScheduler(**recipe["scheduler"])

    # diffusers annotates text_encoder/tokenizer as required, but None is how a pipeline is saved without them.
    pipeline = QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=None,  # type: ignore[arg-type]
        tokenizer=None,  # type: ignore[arg-type]
        transformer=transformer,
    )
    pipeline.save_pretrained(str(work_dir), safe_serialization=True)


def write_marker(work_dir: Path, recipe: dict, config_hash: str) -> None:
    import diffusers
    import torch

    marker = {
        "config_sha256": config_hash,
        "recipe": recipe,
        "diffusers": diffusers.__version__,
        "torch": torch.__version__,
    }
    with open(work_dir / MARKER, "w") as f:
        json.dump(marker, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def build_once(out_dir: Path, recipe: dict, build_into: Callable[[Path], None], force: bool = False) -> bool:
    """Build ``recipe``'s folder at ``out_dir`` with ``build_into`` (given a fresh work folder beside it), marked and
    installed whole, unless a complete build of the same recipe is there (False: nothing done) or ``force``."""
    config_hash = recipe_hash(recipe)
    out_dir = out_dir.expanduser().resolve()
    if not force and is_complete(out_dir, config_hash):
        print(f"{out_dir} is complete (config sha256 {config_hash[:12]}); nothing to do")
        return False
    started = time.monotonic()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        build_into(work_dir)
        # The marker goes last: a directory without it is never mistaken for a finished build.
        write_marker(work_dir, recipe, config_hash)
        install(work_dir, out_dir)
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    print(f"wrote {out_dir} in {time.monotonic() - started:.1f}s")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=default_model_dir(PLUMBING_DIT_MODEL),
        help=f"output dir (default: $ARDIT_CACHE_DIR/models/{PLUMBING_DIT_MODEL}, "
        "ARDIT_CACHE_DIR defaults to ~/.cache/ardit)",
    )
    ap.add_argument(
        "--ar-model",
        type=Path,
        default=None,
        help="AR checkpoint dir; its config.json hidden_size sets joint_attention_dim",
    )
    ap.add_argument(
        "--joint-attention-dim",
        type=int,
        default=None,
        help=f"override joint_attention_dim (default {DEFAULT_JOINT_ATTENTION_DIM}, or --ar-model's)",
    )
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = ap.parse_args(argv)

    if args.joint_attention_dim is not None:
        joint_attention_dim = args.joint_attention_dim
    elif args.ar_model is not None:
        joint_attention_dim = joint_attention_dim_of(args.ar_model.expanduser())
    else:
        joint_attention_dim = DEFAULT_JOINT_ATTENTION_DIM
    if joint_attention_dim <= 0:
        raise SystemExit(f"joint_attention_dim must be positive, got {joint_attention_dim}")

    recipe = build_recipe(joint_attention_dim, args.seed)
    config_hash = recipe_hash(recipe)
    out_dir = args.out.expanduser().resolve()
    if not args.force and is_complete(out_dir, config_hash):
        print(f"{out_dir} is complete (config sha256 {config_hash[:12]}); nothing to do")
        return 0

    t0 = time.monotonic()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        build(recipe, work_dir)
        # The marker goes last: a directory without it is never mistaken for a finished build.
        write_marker(work_dir, recipe, config_hash)
        install(work_dir, out_dir)
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    print(
        f"wrote {out_dir} (joint_attention_dim {joint_attention_dim}, seed {args.seed}) in {time.monotonic() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
