"""Make a copy of a Qwen-Image folder whose text encoder is saved in fp32, for ``vllm-omni serve --dtype float32``.

Why: vLLM-Omni 0.30.0's QwenImagePipeline loads ``text_encoder/`` with transformers' ``from_pretrained`` and no
dtype, so it runs in the dtype the checkpoint was saved in (``torch_dtype`` in its config.json; bfloat16 for
``qwen-image-full-tiny``, as for the published Qwen-Image), while ``--dtype`` only sets the DiT's. The prompt
embeddings then reach an fp32 DiT as bf16, and the first linear layer (oneDNN on CPU) fails the warm-up run with
``RuntimeError: expected scalar type BFloat16 but found Float``.

What: ``OUT/text_encoder/`` holds the same weights upcast to fp32 (exact) with ``torch_dtype``/``dtype`` set to
float32 in its config; every other entry of the folder (model_index.json, transformer/, vae/, scheduler/,
tokenizer/) is a symlink to the original, which is never written. Idempotent: an existing OUT is rebuilt.

    .venv-vllm-omni/bin/python benchmarks/vllm_omni/fp32_text_encoder.py SRC OUT
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="a Qwen-Image folder (model_index.json, text_encoder/, ...)")
    parser.add_argument("out", type=Path, help="the folder to create (replaced if it exists)")
    args = parser.parse_args()
    src: Path = args.src.expanduser().resolve()
    out: Path = args.out.expanduser().absolute()
    if not (src / "text_encoder" / "config.json").is_file():
        raise SystemExit(f"{src} has no text_encoder/config.json: not a full Qwen-Image folder")
    if out == src:
        raise SystemExit("OUT must differ from SRC")

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for entry in sorted(src.iterdir()):
        if entry.name not in ("text_encoder", ".complete"):
            (tmp / entry.name).symlink_to(entry)

    te_src, te_out = src / "text_encoder", tmp / "text_encoder"
    te_out.mkdir()
    for entry in sorted(te_src.iterdir()):
        if entry.suffix == ".safetensors":
            tensors = {
                name: t.to(torch.float32) if t.is_floating_point() else t for name, t in load_file(entry).items()
            }
            save_file(tensors, te_out / entry.name, metadata={"format": "pt"})
        elif entry.name == "model.safetensors.index.json":
            index = json.loads(entry.read_text())
            index.get("metadata", {}).pop("total_size", None)  # sizes double; transformers does not need it
            (te_out / entry.name).write_text(json.dumps(index, indent=2) + "\n")
        elif entry.name == "config.json":
            config = json.loads(entry.read_text())
            for key in ("torch_dtype", "dtype"):
                if key in config:
                    config[key] = "float32"
            if "text_config" in config and isinstance(config["text_config"], dict):  # transformers 5's nested form
                for key in ("torch_dtype", "dtype"):
                    if key in config["text_config"]:
                        config["text_config"][key] = "float32"
            if "torch_dtype" not in config and "dtype" not in config:
                config["torch_dtype"] = "float32"
            (te_out / entry.name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            shutil.copy2(entry, te_out / entry.name)

    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"{out}: text_encoder/ in fp32, the rest linked to {src}")


if __name__ == "__main__":
    main()
