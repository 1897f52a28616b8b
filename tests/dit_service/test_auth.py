from __future__ import annotations

import pytest
from pydantic import SecretStr

from dit_service.auth import HandoffAuth
from services.errors import ApiError


def test_right_token_passes():
    HandoffAuth(SecretStr("s3cret")).check("Bearer s3cret")
    HandoffAuth(SecretStr("s3cret")).check("bearer s3cret")


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer nope", "Basic s3cret", "s3cret"])
def test_missing_or_wrong_token_is_401(header):
    with pytest.raises(ApiError) as refused:
        HandoffAuth(SecretStr("s3cret")).check(header)
    assert refused.value.status == 401 and refused.value.code == "invalid_handoff_token"
    assert refused.value.headers == {"WWW-Authenticate": "Bearer"}


@pytest.mark.parametrize("token", [None, SecretStr("")])
def test_no_configured_token_refuses_everyone(token):
    with pytest.raises(ApiError) as refused:
        HandoffAuth(token).check("Bearer anything")
    assert refused.value.status == 503 and refused.value.code == "handoff_auth_not_configured"
