"""Fixtures the end-to-end tests share."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.conftest import API_KEY, Stack


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    """The official ``openai`` client on the session's pair: its strict response validation checks every answer's
    shape, no retries (one would hide a failure), and a timeout that only a hang reaches."""
    return OpenAI(
        base_url=stack.api_base, api_key=API_KEY, max_retries=0, timeout=300, _strict_response_validation=True
    )
