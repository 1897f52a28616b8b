import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ar_service.engine.final_norm import FinalNorm


def test_matches_transformers_rms_norm():
    norm = LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
    rows = torch.randn(7, 16) * 30
    assert torch.equal(FinalNorm(norm.weight.detach(), 1e-5)(rows), norm(rows).detach())
