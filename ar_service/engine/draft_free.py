"""Capture without vLLM's duplicate decode token: ``extract_hidden_states`` proposes no draft.

vLLM 0.32 captures hidden states through a speculative method. After every target forward, the
``extract_hidden_states`` proposer runs a cache-only "draft" layer that writes the rows of all
scheduled tokens into the paged cache, and then returns the token just sampled as a one-token
draft. The scheduler feeds that draft back, so every decode step runs two tokens per request
through the whole model (the real input and a copy of it one position further, attending over the
whole context) and the rejection sampler throws the copy away unless the model repeated its last
token. Capture gains nothing from it: the rows it needs are those of the real tokens, which the
proposer writes anyway.

``install()`` makes the proposer return a zero-width draft. The scheduler then has no draft to
schedule, decode steps carry one token per request as they do without capture, and the proposer
still writes every scheduled token's row. ``benchmarks/capture_decode.py`` measures the difference.

Upstream this is a small change: accept ``num_speculative_tokens=0`` for ``extract_hidden_states``
(its proposer returns ``sampled_token_ids[:, :0]`` and the runner skips the draft copy when the
draft is empty). Until vLLM has it, the proposer method is wrapped where the model runs, for the
one vLLM version the wrapper was checked against.
"""

from __future__ import annotations

import functools
from typing import Any

import vllm
from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

CHECKED_VLLM = "0.32.0"
_WRAPPED = "_ardit_draft_free"


def install() -> None:
    """Make every ``ExtractHiddenStatesProposer`` in this process propose an empty draft (idempotent)."""
    if vllm.__version__ != CHECKED_VLLM:
        raise RuntimeError(
            f"draft-free capture was checked against vLLM {CHECKED_VLLM}, this is {vllm.__version__}: "
            "check ExtractHiddenStatesProposer.propose still returns the sampled token as its draft, "
            "or turn capture_without_draft off"
        )
    if installed():
        return
    propose = ExtractHiddenStatesProposer.propose

    @functools.wraps(propose)
    def propose_no_draft(self: ExtractHiddenStatesProposer, *args: Any, **kwargs: Any) -> Any:
        drafts = propose(self, *args, **kwargs)  # writes this step's rows; returns [requests, 1]
        return drafts[:, :0]

    setattr(propose_no_draft, _WRAPPED, True)
    ExtractHiddenStatesProposer.propose = propose_no_draft  # type: ignore[method-assign]


def installed() -> bool:
    """Whether this process's proposers already propose no draft (the wrap is not undone)."""
    return bool(getattr(ExtractHiddenStatesProposer.propose, _WRAPPED, False))
