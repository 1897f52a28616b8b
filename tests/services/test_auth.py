from __future__ import annotations

import pytest

from services.auth import BearerAuth
from services.errors import ApiError


def auth(*tokens: str) -> BearerAuth:
    return BearerAuth(tokens, what="token", missing_code="missing_token", invalid_code="invalid_token")


def test_any_configured_token_passes_whatever_the_scheme_case():
    auth("s3cret", "other").check("Bearer s3cret")
    auth("s3cret", "other").check("bearer other")


@pytest.mark.parametrize(
    ("header", "code"),
    [
        (None, "missing_token"),
        ("", "missing_token"),
        ("Bearer", "missing_token"),
        ("Bearer   ", "missing_token"),
        ("Basic s3cret", "missing_token"),
        ("s3cret", "missing_token"),
        ("Bearer nope", "invalid_token"),
        ("Bearer s3cre", "invalid_token"),
        # Starlette decodes header bytes as latin-1: non-ASCII reaches the check as such characters.
        ("Bearer s3cr\u00e9t", "invalid_token"),
        ("Bearer \u00ff\u00fe", "invalid_token"),
    ],
)
def test_missing_wrong_or_non_ascii_token_is_a_401_not_an_exception(header, code):
    with pytest.raises(ApiError) as refused:
        auth("s3cret").check(header)
    assert refused.value.status == 401 and refused.value.code == code
    assert refused.value.headers == {"WWW-Authenticate": "Bearer"}


def test_an_empty_configured_token_is_no_token_and_an_empty_bearer_never_passes():
    empty = auth("")
    assert not empty.enabled
    for header in ("Bearer ", "Bearer"):
        with pytest.raises(ApiError):
            empty.check(header)


def test_enabled_iff_a_token_is_configured():
    assert auth("x").enabled and not auth().enabled


def test_each_token_names_its_own_tenant_and_the_name_does_not_contain_the_token():
    auth = BearerAuth(["key-one", "key-two"], what="API key", missing_code="m", invalid_code="i")
    one, two = auth.check("Bearer key-one"), auth.check("Bearer key-two")
    assert one != two and auth.check("Bearer key-one") == one
    assert "key-one" not in one and len(one) == 32
