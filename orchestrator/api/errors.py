"""ErrorCode -> HTTP status, and the handlers that make every failure an envelope."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.api.envelope import fail_body
from stages.errors import ErrorCode, ItoError

log = logging.getLogger("ito.api")
E = ErrorCode

_STATUS_GROUPS: dict[int, tuple[ErrorCode, ...]] = {
    400: (E.bad_request, E.idempotency_key_invalid,
          # Client-side codes never come from the server; 400 if one ever did.
          E.api_unreachable, E.api_timeout, E.ambiguous_transport_failure,
          E.credentials_missing, E.credentials_file_insecure, E.manifest_path_not_absolute,
          E.manifest_path_not_canonical, E.manifest_symlink, E.manifest_not_regular_file,
          E.manifest_not_owned, E.manifest_insecure_permissions, E.manifest_unreadable),
    401: (E.unauthenticated, E.credential_revoked, E.account_disabled),
    403: (E.forbidden_scope, E.booking_account_mismatch, E.confirmation_not_found,
          E.confirmation_expired, E.confirmation_account_mismatch,
          E.confirmation_action_mismatch, E.confirmation_booking_mismatch,
          E.confirmation_digest_mismatch, E.confirmation_run_mismatch,
          E.confirmation_self_approved,
          E.confirmation_cost_exceeded, E.driver_not_authorized),
    404: (E.not_found, E.booking_not_found, E.run_not_found, E.proposal_not_found,
          E.checkpoint_not_found),
    405: (E.method_not_allowed,),
    409: (E.booking_expired, E.booking_not_started, E.booking_revoked, E.booking_released,
          E.booking_exists, E.confirmation_consumed, E.idempotency_conflict, E.invalid_state),
    413: (E.payload_too_large, E.manifest_too_large),
    422: (E.validation_error, E.booking_incomplete, E.manifest_invalid,
          E.manifest_contains_secret, E.manifest_digest_mismatch, E.confirmation_ttl_invalid,
          E.capacity_insufficient, E.fabric_unknown, E.gpu_sku_unknown,
          E.model_preset_unknown, E.data_scheme_not_allowed, E.data_provenance_missing,
          E.checkpoint_storage_invalid, E.checkpoint_storage_unwritable, E.budget_exceeded,
          E.incremental_cost_exceeded, E.plan_out_of_memory, E.plan_tp_across_nodes,
          E.plan_tp_beyond_nvlink, E.plan_heads_not_divisible, E.plan_pp_layers_unbalanced,
          E.plan_pp_bubble_too_large, E.plan_batch_not_divisible, E.plan_fp8_unsupported,
          E.plan_degrees_mismatch, E.plan_wasteful, E.plan_no_feasible, E.data_not_found,
          E.data_remote_not_cached, E.data_format_unsupported, E.data_digest_mismatch,
          E.data_empty, E.eval_suite_unknown, E.gate_failed, E.path_outside_root,
          E.plan_time_budget_exceeded, E.eval_battery_unknown,
          E.eval_metric_unknown, E.curriculum_invalid, E.eval_gate_failed,
          E.tokenizer_invalid, E.layout_unsupported, E.post_training_data_invalid,
          E.post_training_model_invalid, E.reward_unknown, E.checkpoint_untrusted),
    428: (E.confirmation_required, E.idempotency_key_missing),
    429: (E.rate_limited,),
    500: (E.internal_error, E.checkpoint_corrupt, E.all_replica_groups_lost,
          E.training_failed, E.stage_failed, E.driver_lost, E.rollout_fleet_failed),
    503: (E.ray_unavailable, E.booking_nodes_unavailable, E.placement_timeout),
}
HTTP_STATUS: dict[ErrorCode, int] = {
    code: status for status, codes in _STATUS_GROUPS.items() for code in codes}


def status_of(code: ErrorCode | str) -> int:
    try:
        return HTTP_STATUS.get(ErrorCode(code), 400)
    except ValueError:
        return 500


def error_response(code: ErrorCode | str, message: str, notice: str = "") -> JSONResponse:
    status = status_of(code)
    headers = {"WWW-Authenticate": 'Bearer realm="ito"'} if status == 401 else None
    return JSONResponse(fail_body(code, message, notice), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    """Where and what, never the offending input (it could be a secret)."""
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if isinstance(x, str | int))
        parts.append(f"{loc[:120]}: {str(err.get('msg', 'invalid'))[:200]}")
    return "; ".join(parts) or "invalid request"


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ItoError)
    async def _ito(_: Request, exc: ItoError) -> JSONResponse:
        return error_response(exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(E.validation_error, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: E.not_found, 405: E.method_not_allowed, 413: E.payload_too_large,
                429: E.rate_limited}.get(exc.status_code, E.bad_request)
        if exc.status_code >= 500:
            code = E.internal_error
        message = {404: "no such route", 405: "method not allowed on this route"}.get(
            exc.status_code, "request refused")
        resp = JSONResponse(fail_body(code, message), status_code=exc.status_code)
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        # Log the type and traceback for operators; the tenant gets a stable code only.
        log.error("unhandled %s", type(exc).__name__, exc_info=exc)
        return error_response(E.internal_error, "internal error")
