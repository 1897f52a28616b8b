"""``/admin/*``: operator endpoints, behind their own bearer token (``ARDIT_AR_ADMIN_TOKEN``).

Without a (non-empty) admin token the routes do not exist: they answer 404 like any unknown path.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ar_service.engine.hidden_state_engine import HiddenStateEngine
from services.auth import BearerAuth
from services.errors import ApiError


def admin_auth(token: str | None) -> BearerAuth:
    """The operator's bearer: ``/admin/*``, and ``/metrics`` on the public port when API keys are on."""
    return BearerAuth(
        [token] if token else [],
        what="admin token",
        missing_code="invalid_admin_token",
        invalid_code="invalid_admin_token",
    )


def build_admin_router(admin: BearerAuth, engine: HiddenStateEngine) -> APIRouter:
    router = APIRouter()

    @router.post("/admin/reset_prefix_cache", include_in_schema=False)
    async def reset_prefix_cache(request: Request) -> dict[str, bool]:
        if not admin.enabled:
            raise ApiError(404, "not found", code="not_found")
        admin.check(request.headers.get("authorization"))
        return {"reset": await engine.reset_prefix_cache()}

    return router
