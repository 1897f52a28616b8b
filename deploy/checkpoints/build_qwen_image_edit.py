#!/usr/bin/env python3
"""Build a tiny Qwen-Image-Edit-2511, in the folder layout Qwen-Image-Edit-2511 is published in.

The real one is Qwen-Image's 20B DiT plus its 7B Qwen2.5-VL, which reads the user's pictures as well as the
instruction; no hub is reachable here, so the path a user of the real model takes
(``QwenImageEditPlusPipeline.from_pretrained(folder)``) is proven on this: seeded random weights of the real
architecture, at a toy size.

- ``text_encoder/``, ``tokenizer/``, ``vae/``, ``scheduler/``: ``qwen-image-full-tiny``'s
  (``build_qwen_image_full``'s recipe and functions, the same seed: the same bytes). The text encoder is a
  ``Qwen2_5_VLForConditionalGeneration`` with its 2-block vision tower (``vision_config`` nested), so a picture
  changes the rows the DiT is conditioned on.
- ``processor/``: what the edit pipeline reads pictures with, a ``Qwen2VLProcessor`` (patch 14, merge 2, temporal
  patch 2, ``min_pixels`` 3136, ``max_pixels`` 12845056, CLIP mean and std), built with transformers and saved
  part by part in the published layout: ``preprocessor_config.json`` (``Qwen2VLImageProcessor``),
  ``video_preprocessor_config.json``, Qwen's tokenizer files and Qwen2-VL's chat template (``chat_template.jinja``).
  transformers 5 would save one ``processor_config.json`` instead; the published folder (saved by transformers 4)
  has no such file, and its ``preprocessor_config.json`` names ``processor_class``, which transformers 5 no longer
  writes and ``AutoProcessor`` needs to find the processor from that folder.
- ``transformer/``: the plumbing DiT's recipe (``build_tiny_qwen_image``) at the text encoder's width
  (``joint_attention_dim`` 128), 2 layers, with ``zero_cond_t: true``, the key that tells 2511's published
  transformer from 2509's: the condition pictures' latent tokens are modulated at timestep 0, the noise's at the
  step's (diffusers' ``QwenImageTransformer2DModel`` doubles the timestep batch and gives each token a
  ``modulate_index``). Drawn so that the conditioning shows in the output and bf16 does not drown it
  (``TRANSFORMER_INIT``: Linear weights with std 1.2 / sqrt(fan_in), attention q/k RMSNorm weights around 4, the
  rows' RMSNorm around 1, nn.Linear's biases around 0, a timestep embedder that reads only the slow sinusoids):
  at torch's default init one changed word or another picture moved a 64x64 output by 1/255. bf16.
- ``model_index.json``: ``QwenImageEditPlusPipeline`` with its six parts (``processor`` included), as diffusers
  saves it. No ``ardit.json``: the folder is served with the edit model's own defaults (``services.model_card``).

Usage: ``python -m deploy.checkpoints.build_qwen_image_edit [--out DIR] [--seed N] [--force]``
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

from deploy.checkpoints import build_qwen_image_full as full
from deploy.checkpoints.build_tiny_qwen_image import build_once, build_recipe
from services.checkpoints import QWEN_IMAGE_EDIT_MODEL, default_model_dir

RECIPE_VERSION = 1  # bump when the build changes in a way the recipe does not show
PROCESSOR_CLASS = "Qwen2VLProcessor"

# Qwen-Image-Edit-2511's processor/preprocessor_config.json, as its image processor's arguments.
IMAGE_PROCESSOR_CONFIG: dict[str, Any] = {
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
}

# Qwen2-VL's (and Qwen2.5-VL's) processor chat template: a picture or video in a message becomes its vision tokens.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The DiT's weights: a seeded random QwenImageTransformer2DModel is nearly blind to its conditioning. The noise's 16
# tokens (64x64) attend over ~4,270 (the condition picture's ~4,056 latent tokens at the 1024x1024 area, ~200 rows),
# and "a" vs "b" changes one row of them: with torch's default init (2 layers) that moved the output by 1/255 and a
# different picture by 1/255. Sharper attention (q/k RMSNorm weights around 4, so logits std ~16 not ~1) and larger
# Linear weights make one row or picture count, but also make the model chaotic in bf16, and the reference tests
# compare ardit's bf16 error with diffusers' own bf16-vs-fp32 error, which must then be far smaller than a wrong
# picture's. Measured with diffusers' pipeline (64x64, 3 steps, seed 11, rows from its encoder, pictures 96x64 of
# seeded noise 1-3; "wrong latents": picture 99's latents beside picture 1's rows), as levels of 255, mean/max:
#
#   init (seed 0)                       another picture  "a" vs "b"   wrong latents  bf16 vs fp32
#   4 layers, std sqrt(2), q/k 3.5-4.5       29-33/194-211   5.9/63        16.7/143       41/234-254
#   the same, sinusoids <= 0.01 rad only     25-30/176-200   10.8/111      17.6/150       8.4-12.5/75-110
#   2 layers, std 1.2, q/k 3.5-4.5, <= 0.003 14-15/117-156   3.0-6.0/27-51 3.6/54         1.5-1.9/12-16
#     with CFG (true_cfg_scale 4, " ")       18-20/164-181   14-17/118-159 6.0/63         2.7-3.8/28-32
#
# Most of the old bf16 error was the timestep: diffusers' bf16 pipeline rounds t to bf16 before the embedding (582.4 to
# 584), which turns each sinusoid of f rad per unit of t by up to 2f (the fastest, f = 1, by 2 rad), and random
# weights read them all (a bf16 DiT fed the fp32 t: 18/180 of the 41/245). So the timestep embedder's first Linear
# reads only the sinusoids of at most 0.003 rad per unit (47 of 128 frequencies; the rest of its columns 0, the kept
# ones scaled to their fan-in), as a trained model ignores what bf16 cannot resolve; and 2 layers at std 1.2 keep the
# rest of the bf16 error (its DiT's arithmetic ~1/255 mean, the bf16 VAE's decode ~0.9/255) under a fifth of another
# picture's, mean and max, with CFG and without. (2 layers at std sqrt(2), q/k 2.5-3.5: as sensitive, but wrong
# latents 1.7/20 against a bf16 error of 1.5/10; 3 layers or q/k 4-5: wrong latents up to 7.7 but bf16 errors up to
# 4/55.)
TRANSFORMER_LAYERS = 2
TRANSFORMER_INIT: dict[str, Any] = {
    "linear_weight_std_times_sqrt_fan_in": 1.2,
    "attention_qk_norm_weights": [3.5, 4.5],
    "norm_weights": [0.5, 1.5],  # the rows' RMSNorm (txt_norm)
    "timestep_embedding_max_frequency": 0.003,  # rad per unit of t (0-1000): the sinusoids the DiT reads
}
QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def recipe(seed: int) -> dict[str, Any]:
    dit = build_recipe(full.TEXT_CONFIG["hidden_size"], seed)
    dit["transformer"] = {**dit["transformer"], "num_layers": TRANSFORMER_LAYERS, "zero_cond_t": True}
    return {
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "text": full.TEXT_CONFIG,
        "vision": full.VISION_CONFIG,
        "dit": dit,
        "transformer_init": TRANSFORMER_INIT,
        "image_processor": IMAGE_PROCESSOR_CONFIG,
        "chat_template": CHAT_TEMPLATE,
    }


def edit_transformer(spec: dict[str, Any]) -> Any:
    """The tiny 2511 DiT, seeded, drawn as ``TRANSFORMER_INIT`` says (its biases are nn.Linear's, around 0), bf16."""
    import torch
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

    init = spec["transformer_init"]
    torch.manual_seed(spec["seed"])
    model = QwenImageTransformer2DModel(**spec["dit"]["transformer"])
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, init["linear_weight_std_times_sqrt_fan_in"] / math.sqrt(module.in_features))
            elif isinstance(module, RMSNorm) and module.weight is not None:
                qk = name.rsplit(".", 1)[-1] in QK_NORMS
                low, high = init["attention_qk_norm_weights"] if qk else init["norm_weights"]
                module.weight.uniform_(low, high)
        read_slow_sinusoids(model.time_text_embed.timestep_embedder.linear_1, init["timestep_embedding_max_frequency"])
    return model.to(torch.bfloat16)


def read_slow_sinusoids(linear: Any, max_frequency: float) -> None:
    """Zero the columns of the Linear that reads diffusers' 256 timestep sinusoids (cos then sin of t * 10000^(-k/128),
    t in 0-1000) whose frequency is above ``max_frequency``; scale the rest to the fan-in they keep."""
    import torch

    half = linear.in_features // 2
    frequency = torch.exp(-math.log(10000) * (torch.arange(linear.in_features) % half) / half)
    kept = frequency <= max_frequency
    linear.weight[:, ~kept] = 0
    linear.weight.mul_(math.sqrt(linear.in_features / int(kept.sum())))


def processor(spec: dict[str, Any], tokenizer_dir: Path) -> Any:
    from transformers import Qwen2Tokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**spec["image_processor"]),
        tokenizer=Qwen2Tokenizer.from_pretrained(str(tokenizer_dir)),
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=spec["chat_template"],
    )


def publish_processor(spec: dict[str, Any], built: Any, folder: Path, tokenizer_dir: Path) -> None:
    """``processor/`` as the published folder has it (transformers 4's layout), in place of transformers 5's."""
    shutil.rmtree(folder)
    folder.mkdir()
    built.image_processor.save_pretrained(str(folder))
    built.video_processor.save_pretrained(str(folder))
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        path = folder / name
        config = json.loads(path.read_text())
        config["processor_class"] = PROCESSOR_CLASS
        if name == "preprocessor_config.json":
            # transformers 5 keeps the pixel bounds only inside ``size``; the published file also has them as keys.
            config.update(
                min_pixels=spec["image_processor"]["min_pixels"], max_pixels=spec["image_processor"]["max_pixels"]
            )
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in full.TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(built.chat_template)


def build(spec: dict[str, Any], work_dir: Path, tokenizer_dir: Path) -> None:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import QwenImageEditPlusPipeline
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2Tokenizer

    seed, dit = spec["seed"], spec["dit"]
    built_processor = processor(spec, tokenizer_dir)
    pipeline = QwenImageEditPlusPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**dit["scheduler"]),
        vae=full.vae(seed, dit),
        text_encoder=full.text_encoder(spec),
        tokenizer=Qwen2Tokenizer.from_pretrained(str(tokenizer_dir)),
        processor=built_processor,
        transformer=edit_transformer(spec),
    )
    pipeline.save_pretrained(str(work_dir), safe_serialization=True)
    full.publish_text_parts(spec, work_dir, tokenizer_dir)
    publish_processor(spec, built_processor, work_dir / "processor", tokenizer_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=default_model_dir(QWEN_IMAGE_EDIT_MODEL), help="output dir")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = ap.parse_args(argv)

    spec = recipe(args.seed)
    build_once(args.out, spec, lambda work_dir: build(spec, work_dir, full.tokenizer_files()), args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
