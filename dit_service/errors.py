"""Rejections the DiT adds to the contract's own (shared/errors.py).

They are ``HandoffError``s, so one handler answers every way a handoff can fail with the same
OpenAI-shaped body: ``error.type`` = "handoff_error", ``error.code`` = the class's ``code``,
``error.param`` the public API parameter at fault where there is one.
"""

from __future__ import annotations

from shared.errors import HandoffError


class HandoffStalled(HandoffError):
    """No bytes arrived for longer than the stall timeout."""

    code = "handoff_stalled"
    status = 408


class HandoffDeadlineExceeded(HandoffError):
    """The handoff took longer than the deadline from its first byte to close (a trickling sender)."""

    code = "handoff_deadline_exceeded"
    status = 408


class ConditioningMismatch(HandoffError):
    """The hidden states cannot condition this DiT: wrong width, unknown adapter or wrong AR model."""

    code = "conditioning_mismatch"
    status = 422


class PromptTooLong(HandoffError):
    """More conditioning rows than the DiT takes (``max_sequence_length``)."""

    code = "prompt_too_long"
    status = 422


class EmptyConditioning(HandoffError):
    """The adapter selected no rows: the prompt is entirely template prefix or special tokens."""

    code = "empty_conditioning"
    status = 422
