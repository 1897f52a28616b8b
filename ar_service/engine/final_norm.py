"""The model's final RMSNorm, applied to captured rows when the DiT expects post-norm states.

vLLM's ``extract_hidden_states`` captures the configured decoder layer's output *before* the final
norm (verified against transformers: pre-norm matches to 2e-6). Qwen-Image and most AR→DiT
models were trained on post-norm hidden states, so by default the rows are normalised here,
with the checkpoint's own weight and epsilon, exactly as transformers' ``LlamaRMSNorm`` /
``Qwen2RMSNorm`` compute it (fp32 math, result cast back to the source dtype).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

NORM_WEIGHT_KEY = "model.norm.weight"


class FinalNorm:
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight
        self.eps = eps

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, eps: float | None = None) -> FinalNorm:
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        eps = config.get("rms_norm_eps", 1e-6) if eps is None else eps
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                if NORM_WEIGHT_KEY in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    return cls(f.get_tensor(NORM_WEIGHT_KEY), eps)
        raise FileNotFoundError(f"{NORM_WEIGHT_KEY} not found in {model_dir}/*.safetensors")

    def to(self, device: torch.device | str) -> FinalNorm:
        return FinalNorm(self.weight.to(device), self.eps)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        x = rows.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(rows.dtype) * x.to(rows.dtype)
