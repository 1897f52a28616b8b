"""The model's final RMSNorm, applied to captured rows when the DiT expects post-norm states.

vLLM's ``extract_hidden_states`` captures the configured decoder layer's output *before* the final
norm (verified against transformers: pre-norm matches to 2e-6). Qwen-Image and most AR→DiT
models were trained on post-norm hidden states, so by default the rows are normalised here,
with the checkpoint's own weight and epsilon, exactly as transformers' ``LlamaRMSNorm`` /
``Qwen2RMSNorm`` compute it (fp32 math, result cast back to the source dtype). The epsilon is the
text config's (a multimodal checkpoint nests it in ``text_config``), as the engine read it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

# The final norm's weight under the key layouts checkpoints are saved with (a multimodal model saved by
# transformers >= 4.52 may nest its language model; a bare decoder, Z-Image's ``Qwen3Model``, has no prefix).
NORM_WEIGHT_KEYS = ("model.norm.weight", "model.language_model.norm.weight", "norm.weight")


class FinalNorm:
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight
        self.eps = eps

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, eps: float) -> FinalNorm:
        model_dir = Path(model_dir)
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                key = next((k for k in NORM_WEIGHT_KEYS if k in f.keys()), None)  # noqa: SIM118 - not a dict
                if key is not None:
                    return cls(f.get_tensor(key), eps)
        raise FileNotFoundError(f"none of {', '.join(NORM_WEIGHT_KEYS)} in {model_dir}/*.safetensors")

    def to(self, device: torch.device | str) -> FinalNorm:
        return FinalNorm(self.weight.to(device), self.eps)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        x = rows.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(rows.dtype) * x.to(rows.dtype)
