"""The one enum of stable error codes, shared by the API and every stage.

It lives in ``stages`` because stages must not import the orchestrator, while the
orchestrator imports stages; both need the same codes. A code, once published,
is never renamed or reused (clients switch on it).
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    # --- transport, envelope, generic -------------------------------------------------
    bad_request = "bad_request"
    validation_error = "validation_error"
    not_found = "not_found"
    method_not_allowed = "method_not_allowed"
    payload_too_large = "payload_too_large"
    internal_error = "internal_error"
    rate_limited = "rate_limited"
    # --- client-side (live_api_contacted=false) ---------------------------------------
    api_unreachable = "api_unreachable"
    api_timeout = "api_timeout"
    ambiguous_transport_failure = "ambiguous_transport_failure"
    credentials_missing = "credentials_missing"
    credentials_file_insecure = "credentials_file_insecure"
    manifest_path_not_absolute = "manifest_path_not_absolute"
    manifest_path_not_canonical = "manifest_path_not_canonical"
    manifest_symlink = "manifest_symlink"
    manifest_not_regular_file = "manifest_not_regular_file"
    manifest_not_owned = "manifest_not_owned"
    manifest_insecure_permissions = "manifest_insecure_permissions"
    manifest_too_large = "manifest_too_large"
    manifest_unreadable = "manifest_unreadable"
    # --- authentication / authorization -----------------------------------------------
    unauthenticated = "unauthenticated"
    credential_revoked = "credential_revoked"
    forbidden_scope = "forbidden_scope"
    # --- booking eligibility ----------------------------------------------------------
    booking_not_found = "booking_not_found"
    booking_expired = "booking_expired"
    booking_not_started = "booking_not_started"
    booking_revoked = "booking_revoked"
    booking_released = "booking_released"
    booking_incomplete = "booking_incomplete"
    booking_account_mismatch = "booking_account_mismatch"
    booking_exists = "booking_exists"
    # --- manifest ---------------------------------------------------------------------
    manifest_invalid = "manifest_invalid"
    manifest_contains_secret = "manifest_contains_secret"
    manifest_digest_mismatch = "manifest_digest_mismatch"
    # --- confirmations ----------------------------------------------------------------
    confirmation_required = "confirmation_required"
    confirmation_not_found = "confirmation_not_found"
    confirmation_expired = "confirmation_expired"
    confirmation_consumed = "confirmation_consumed"
    confirmation_account_mismatch = "confirmation_account_mismatch"
    confirmation_action_mismatch = "confirmation_action_mismatch"
    confirmation_booking_mismatch = "confirmation_booking_mismatch"
    confirmation_digest_mismatch = "confirmation_digest_mismatch"
    confirmation_run_mismatch = "confirmation_run_mismatch"
    confirmation_self_approved = "confirmation_self_approved"
    confirmation_cost_exceeded = "confirmation_cost_exceeded"
    confirmation_ttl_invalid = "confirmation_ttl_invalid"
    # --- idempotency / runs -----------------------------------------------------------
    idempotency_key_missing = "idempotency_key_missing"
    idempotency_key_invalid = "idempotency_key_invalid"
    idempotency_conflict = "idempotency_conflict"
    run_not_found = "run_not_found"
    invalid_state = "invalid_state"
    proposal_not_found = "proposal_not_found"
    # --- server-side validation -------------------------------------------------------
    capacity_insufficient = "capacity_insufficient"
    fabric_unknown = "fabric_unknown"
    gpu_sku_unknown = "gpu_sku_unknown"
    model_preset_unknown = "model_preset_unknown"
    data_scheme_not_allowed = "data_scheme_not_allowed"
    data_provenance_missing = "data_provenance_missing"
    checkpoint_storage_invalid = "checkpoint_storage_invalid"
    checkpoint_storage_unwritable = "checkpoint_storage_unwritable"
    budget_exceeded = "budget_exceeded"
    incremental_cost_exceeded = "incremental_cost_exceeded"
    # --- planner refusals (stages.parallelism) ----------------------------------------
    plan_out_of_memory = "plan_out_of_memory"
    plan_tp_across_nodes = "plan_tp_across_nodes"
    plan_tp_beyond_nvlink = "plan_tp_beyond_nvlink"
    plan_heads_not_divisible = "plan_heads_not_divisible"
    plan_pp_layers_unbalanced = "plan_pp_layers_unbalanced"
    plan_pp_bubble_too_large = "plan_pp_bubble_too_large"
    plan_batch_not_divisible = "plan_batch_not_divisible"
    plan_fp8_unsupported = "plan_fp8_unsupported"
    plan_degrees_mismatch = "plan_degrees_mismatch"
    plan_wasteful = "plan_wasteful"
    plan_no_feasible = "plan_no_feasible"
    # --- data prep (stages.data_prep) -------------------------------------------------
    data_not_found = "data_not_found"
    data_remote_not_cached = "data_remote_not_cached"
    data_format_unsupported = "data_format_unsupported"
    data_digest_mismatch = "data_digest_mismatch"
    data_empty = "data_empty"
    eval_suite_unknown = "eval_suite_unknown"
    # --- training engine / runtime ----------------------------------------------------
    driver_lost = "driver_lost"
    driver_not_authorized = "driver_not_authorized"
    checkpoint_not_found = "checkpoint_not_found"
    checkpoint_corrupt = "checkpoint_corrupt"
    checkpoint_untrusted = "checkpoint_untrusted"
    all_replica_groups_lost = "all_replica_groups_lost"
    training_failed = "training_failed"
    stage_failed = "stage_failed"
    gate_failed = "gate_failed"
    ray_unavailable = "ray_unavailable"
    # --- placement (runs on their booking's nodes) ------------------------------------
    booking_nodes_unavailable = "booking_nodes_unavailable"
    placement_timeout = "placement_timeout"
    # --- tenant isolation and bounds (issue 14) ---------------------------------------
    path_outside_root = "path_outside_root"
    plan_time_budget_exceeded = "plan_time_budget_exceeded"
    account_disabled = "account_disabled"
    # --- curriculum, eval batteries, HF formats (stages.evals, stages.hf) -------------
    eval_battery_unknown = "eval_battery_unknown"
    eval_metric_unknown = "eval_metric_unknown"
    curriculum_invalid = "curriculum_invalid"
    eval_gate_failed = "eval_gate_failed"
    tokenizer_invalid = "tokenizer_invalid"
    layout_unsupported = "layout_unsupported"
    # --- post-training (stages.post_training) -----------------------------------------
    post_training_data_invalid = "post_training_data_invalid"
    post_training_model_invalid = "post_training_model_invalid"
    reward_unknown = "reward_unknown"
    rollout_fleet_failed = "rollout_fleet_failed"


class ItoError(Exception):
    """An error with a stable code and a message that is safe to show a tenant."""

    def __init__(self, code: ErrorCode, message: str, *, details: dict[str, object] | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details or {}
