"""Rejections the DiT adds to the contract's own (shared/errors.py).

They subclass ``HandoffError`` so one handler answers every way a handoff can fail with the same
OpenAI-shaped body: ``error.type`` = "handoff_error", ``error.code`` = the class's ``code``.
``param`` names the offending field of the ``open`` frame where there is one.
"""

from __future__ import annotations

from shared.errors import HandoffError


class DitRejection(HandoffError):
    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class HandoffStalled(DitRejection):
    """No bytes arrived for longer than the stall timeout."""

    code = "handoff_stalled"
    status = 408


class HandoffDeadlineExceeded(DitRejection):
    """The handoff took longer than the deadline from its first byte to close (a trickling sender)."""

    code = "handoff_deadline_exceeded"
    status = 408


class ConditioningMismatch(DitRejection):
    """The hidden states cannot condition this DiT: wrong width, unknown adapter or wrong AR model."""

    code = "conditioning_mismatch"
    status = 422


class InvalidDiffusionParams(DitRejection):
    """A diffusion parameter this model cannot honour exactly (diffusers would round or fail)."""

    code = "invalid_diffusion_params"
    status = 422


class PromptTooLong(DitRejection):
    code = "prompt_too_long"
    status = 422


class EmptyConditioning(DitRejection):
    """The adapter selected no rows: the prompt is entirely template prefix or special tokens."""

    code = "empty_conditioning"
    status = 422
