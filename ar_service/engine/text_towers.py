"""Text encoders vLLM cannot serve as they are published, each served by vLLM as a text-only causal model.

Z-Image's text encoder is transformers' ``Qwen3Model``, a decoder without an LM head, which vLLM serves only as a
pooling model (``qwen3_decoder``). Qwen-Image's is Qwen2.5-VL: a vision tower and a Qwen2 language model. The AR
only ever feeds it text, so it serves the language model alone, under an architecture of its own:
served multimodal, vLLM builds the checkpoint's image processor to size the vision encoder's budget, and
refuses a folder without ``preprocessor_config.json`` (Qwen-Image's text encoder has none), and it loads a
vision tower no text prompt runs.

For text-only input Qwen2.5-VL's multimodal RoPE gives every token the same position in its three
sections, which is ordinary 1-D RoPE at the same frequencies; its language model is then a Qwen2
decoder (``qwen2_5_vl_text``).

vLLM resolves architectures in every process it starts, so the towers are registered through vLLM's
plugin entry point (``vllm.general_plugins`` in pyproject.toml), by path: the model module is only
imported where a model loads. An engine picks its tower with ``hf_overrides`` (``text_only_overrides``).
"""

from __future__ import annotations

from typing import Any

# A published architecture -> the text-only architecture it is served as, and where that lives.
TEXT_TOWERS = {
    "Qwen2_5_VLForConditionalGeneration": (
        "ArditQwen2_5_VLTextTower",
        "ar_service.engine.qwen2_5_vl_text:Qwen2_5_VLTextTower",
    ),
    "Qwen3Model": ("ArditQwen3Decoder", "ar_service.engine.qwen3_decoder:Qwen3Decoder"),
    "Qwen3VLForConditionalGeneration": (
        "ArditQwen3VLTextTower",
        "ar_service.engine.qwen3_vl_text:Qwen3VLTextTower",
    ),
}
# Towers of a checkpoint without an LM head: the head is the embedding, tied (the sampled token is never read).
HEADLESS = {"Qwen3Model"}


def register() -> None:
    """vLLM's general-plugin hook (run in every vLLM process): make the towers known to its model registry."""
    from vllm import ModelRegistry

    for architecture, model_class in TEXT_TOWERS.values():
        ModelRegistry.register_model(architecture, model_class)


def text_only_overrides(config: Any) -> Any:
    """vLLM's ``hf_overrides`` for a checkpoint served by its text tower: the tower's architecture, and 1-D
    RoPE (text-only positions are equal in every M-RoPE section). vLLM also calls it on a blank config
    (to read the model type it gives), which it returns as it is."""
    architecture = (getattr(config, "architectures", None) or [""])[0]
    tower = TEXT_TOWERS.get(architecture)
    if tower is None:
        return config
    config.architectures = [tower[0]]
    if architecture in HEADLESS:
        config.tie_word_embeddings = True
    text = config.get_text_config()
    for name in ("vocab_size", "hidden_size"):
        # vLLM's causal LMs size their head from the top-level config; Qwen3-VL's keeps them in ``text_config`` only.
        if not hasattr(config, name):
            setattr(config, name, getattr(text, name))
    if not hasattr(text, "tie_word_embeddings"):
        # transformers 5 keeps it on the top-level config only, where a hub-style (flat) config.json puts it.
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    for part in {id(c): c for c in (config, text)}.values():
        for name in ("rope_parameters", "rope_scaling"):
            rope = getattr(part, name, None)
            if isinstance(rope, dict):
                rope.pop("mrope_section", None)
                rope.pop("mrope_interleaved", None)
                if rope.get("rope_type", rope.get("type")) == "mrope":
                    rope["rope_type"] = "default"
                    rope.pop("type", None)
    return config
