"""The one enum of stable error codes, shared by the API and every stage.

It lives in ``stages`` because stages must not import the orchestrator, while the
orchestrator imports stages; both need the same codes. Each code carries the HTTP status
the server answers with and its meaning, so adding a code touches this file only:
docs/errors.md is generated from it (``python -m stages.errors --markdown >
docs/errors.md``) and a test fails when that file is stale. A code, once published, is
never renamed or reused (clients switch on it).
"""

from __future__ import annotations

import argparse
from enum import StrEnum


class ErrorCode(StrEnum):
    # ErrorCode.x is the string "x"; .http_status and .meaning describe it (no class
    # docstring: it would become part of the served OpenAPI schema). Client-side codes
    # never come from the server; their status is what it would answer if one reached it.

    http_status: int
    meaning: str

    # The defaults exist only so type checkers accept the lookup ``ErrorCode("x")``;
    # every member must give both (checked right below the class).
    def __new__(cls, value: str, http_status: int = 0, meaning: str = "") -> ErrorCode:
        member = str.__new__(cls, value)
        member._value_ = value
        member.http_status = http_status
        member.meaning = meaning
        return member

    # --- transport, envelope, generic -------------------------------------------------
    bad_request = (
        "bad_request",
        400,
        "The request is malformed in a way not covered by a more specific code (bad cursor, "
        "missing field for the action).",
    )
    validation_error = (
        "validation_error",
        422,
        "The request body, query or headers failed schema validation (the message names the "
        "field, never the value).",
    )
    not_found = "not_found", 404, "No such route, or an admin command named an unknown account/key."
    method_not_allowed = (
        "method_not_allowed",
        405,
        "The route exists but not with this HTTP method.",
    )
    payload_too_large = "payload_too_large", 413, "The request body exceeds the server's limit."
    internal_error = (
        "internal_error",
        500,
        "An unexpected server error; the server logged it, the tenant gets only this code.",
    )
    rate_limited = "rate_limited", 429, "Too many requests; retry later."
    too_many_concurrent_plans = (
        "too_many_concurrent_plans",
        429,
        "The account already has as many plan validations (`POST /v1/plans`, `POST /v1/runs`) "
        "in flight as the server allows; retry after the `Retry-After` seconds.",
    )
    # --- client-side (live_api_contacted=false) ---------------------------------------
    api_unreachable = (
        "api_unreachable",
        400,
        "Client-side: the API could not be reached (connect failed).",
    )
    api_timeout = (
        "api_timeout",
        400,
        "Client-side: the connect or total timeout expired before an answer.",
    )
    ambiguous_transport_failure = (
        "ambiguous_transport_failure",
        400,
        "Client-side: the request may or may not have reached the server; look the run up by "
        "idempotency key before any retry.",
    )
    credentials_missing = (
        "credentials_missing",
        400,
        "Client-side: no API key in ITO_API_KEY or the credentials file.",
    )
    credentials_file_insecure = (
        "credentials_file_insecure",
        400,
        "Client-side: the credentials file is not 0600 or not owned by the caller.",
    )
    manifest_path_not_absolute = (
        "manifest_path_not_absolute",
        400,
        "Client-side: the manifest path is relative.",
    )
    manifest_path_not_canonical = (
        "manifest_path_not_canonical",
        400,
        "Client-side: the manifest path is not canonical (.., //, trailing components).",
    )
    manifest_symlink = (
        "manifest_symlink",
        400,
        "Client-side: the manifest or a directory on its path is a symlink.",
    )
    manifest_not_regular_file = (
        "manifest_not_regular_file",
        400,
        "Client-side: the manifest is a FIFO, directory, device or socket.",
    )
    manifest_not_owned = (
        "manifest_not_owned",
        400,
        "Client-side: the manifest file is owned by another user.",
    )
    manifest_insecure_permissions = (
        "manifest_insecure_permissions",
        400,
        "Client-side: the manifest file is group- or world-writable.",
    )
    manifest_too_large = (
        "manifest_too_large",
        413,
        "The manifest exceeds the size cap (client-side check, and the server re-checks).",
    )
    manifest_unreadable = (
        "manifest_unreadable",
        400,
        "Client-side: the manifest could not be opened or read.",
    )
    # --- authentication / authorization -----------------------------------------------
    unauthenticated = "unauthenticated", 401, "No API key, or an unknown/invalid key."
    credential_revoked = (
        "credential_revoked",
        401,
        "The API key was revoked; stop polling, do not retry, never start a login by itself.",
    )
    forbidden_scope = (
        "forbidden_scope",
        403,
        "The key is valid but lacks the scope this call needs (e.g. runs:write, confirm:train).",
    )
    # --- booking eligibility ----------------------------------------------------------
    booking_not_found = "booking_not_found", 404, "No booking with this id."
    booking_expired = "booking_expired", 409, "The booking's term has ended."
    booking_not_started = "booking_not_started", 409, "The booking's term has not started yet."
    booking_revoked = "booking_revoked", 409, "The booking was revoked upstream."
    booking_released = (
        "booking_released",
        409,
        "The booking was released (by the tenant's confirmed release, or upstream).",
    )
    booking_term_ended = (
        "booking_term_ended",
        409,
        "Runtime: the run's booking term ended while the run was queued or running; the "
        "supervisor stopped it.",
    )
    operator_stopped = (
        "operator_stopped",
        409,
        "Runtime: an operator stopped the run (`ito-backend runs stop ID --reason ...`, audited).",
    )
    too_many_active_runs = (
        "too_many_active_runs",
        409,
        "The account already has the operator's maximum of active runs "
        "(`serve --max-active-runs-per-account`); the confirmation is not spent.",
    )
    booking_incomplete = (
        "booking_incomplete",
        422,
        "The booking lacks topology (GPU SKU, GPUs per node, node count), region or fabric.",
    )
    booking_account_mismatch = (
        "booking_account_mismatch",
        403,
        "Not answered any more (kept, never reused): another account's booking answers "
        "`booking_not_found`, exactly as a missing one.",
    )
    booking_exists = "booking_exists", 409, "Admin: a booking with this id is already registered."
    booking_node_taken = (
        "booking_node_taken",
        409,
        "Admin: `bookings add`/`add-nodes` names a node another active booking holds (a node "
        "serves one booking at a time).",
    )
    booking_node_unknown = (
        "booking_node_unknown",
        409,
        "Admin: `bookings remove-nodes` names a node the booking does not hold (never added, "
        "or removed already).",
    )
    booking_nodes_invalid = (
        "booking_nodes_invalid",
        422,
        "Admin: a node list is empty, names a node twice, or a name is not 1-128 of "
        "`[A-Za-z0-9_.:-]`; or a booking file's `nodes` and `node_count` disagree.",
    )
    address_in_use = (
        "address_in_use",
        409,
        "Admin: `ito-backend serve` could not bind its metrics port because another process "
        "holds it; the message names the address and the flag (`--metrics-port`, or 0 for a "
        "free port).",
    )
    # --- manifest ---------------------------------------------------------------------
    manifest_invalid = (
        "manifest_invalid",
        422,
        "The manifest is not UTF-8 JSON, has duplicate keys, unknown fields or wrong types "
        "(strict model).",
    )
    manifest_contains_secret = (
        "manifest_contains_secret",
        422,
        "The manifest contains something that looks like a secret (key shape, bearer token, "
        "private key, user:pass@ URI, password/token/secret field). The secret is echoed nowhere.",
    )
    manifest_digest_mismatch = (
        "manifest_digest_mismatch",
        422,
        "manifest_digest is not the sha256 of the manifest bytes sent.",
    )
    # --- confirmations ----------------------------------------------------------------
    confirmation_required = (
        "confirmation_required",
        428,
        "The mutation needs a confirmation_ref and none was given.",
    )
    confirmation_not_found = "confirmation_not_found", 403, "The confirmation reference is unknown."
    confirmation_expired = (
        "confirmation_expired",
        403,
        "The confirmation's lifetime (default 10 min, at most 15) has passed.",
    )
    confirmation_consumed = (
        "confirmation_consumed",
        409,
        "The confirmation was already used (replay); each one authorizes one mutation.",
    )
    confirmation_account_mismatch = (
        "confirmation_account_mismatch",
        403,
        "The confirmation was made for another account.",
    )
    confirmation_action_mismatch = (
        "confirmation_action_mismatch",
        403,
        "The confirmation was made for another action (train, cancel, cleanup, release, restart).",
    )
    confirmation_booking_mismatch = (
        "confirmation_booking_mismatch",
        403,
        "The confirmation was made for another booking.",
    )
    confirmation_digest_mismatch = (
        "confirmation_digest_mismatch",
        403,
        "The confirmation was made for another manifest digest (e.g. the file changed after it "
        "was reviewed).",
    )
    confirmation_run_mismatch = (
        "confirmation_run_mismatch",
        403,
        "The confirmation was made for another run or proposal.",
    )
    confirmation_self_approved = (
        "confirmation_self_approved",
        403,
        "The key that made the confirmation is the key that uses it: the approver must be a "
        "different key from the submitter.",
    )
    confirmation_cost_exceeded = (
        "confirmation_cost_exceeded",
        403,
        "The server's cost estimate is higher than the cost the approver confirmed.",
    )
    confirmation_ttl_invalid = "confirmation_ttl_invalid", 422, "ttl_s is outside 1..900 seconds."
    # --- idempotency / runs -----------------------------------------------------------
    idempotency_key_missing = (
        "idempotency_key_missing",
        428,
        "The mutation needs an Idempotency-Key header.",
    )
    idempotency_key_invalid = (
        "idempotency_key_invalid",
        400,
        "The Idempotency-Key is not 8-128 characters of [A-Za-z0-9._:-].",
    )
    idempotency_conflict = (
        "idempotency_conflict",
        409,
        "The Idempotency-Key was already used for a different request.",
    )
    run_not_found = (
        "run_not_found",
        404,
        "No such run for this account (another tenant's run answers the same).",
    )
    invalid_state = (
        "invalid_state",
        409,
        "The run (or proposal, or booking) is not in a state that allows this; see the transition"
        " table.",
    )
    proposal_not_found = "proposal_not_found", 404, "No such proposal on this run."
    # --- server-side validation -------------------------------------------------------
    capacity_insufficient = (
        "capacity_insufficient",
        422,
        "The model's weights, gradients and optimizer state (16 bytes/param) do not fit the "
        "booking's total GPU memory.",
    )
    fabric_unknown = (
        "fabric_unknown",
        422,
        "The booking's fabric has no profile (name or alias) in configs/fabrics; checked at "
        "`bookings add` and again at the gate.",
    )
    gpu_sku_unknown = (
        "gpu_sku_unknown",
        422,
        "The booking's GPU SKU has no profile (name or alias) in configs/gpus (or no price); "
        "checked at `bookings add` and again at the gate.",
    )
    model_preset_unknown = (
        "model_preset_unknown",
        422,
        "model.preset names no preset in configs/models.",
    )
    data_scheme_not_allowed = (
        "data_scheme_not_allowed",
        422,
        "A data URI uses a scheme this deployment does not allow (only file:// in this build).",
    )
    data_provenance_missing = (
        "data_provenance_missing",
        422,
        "A data reference has no (or an empty) provenance record.",
    )
    checkpoint_storage_invalid = (
        "checkpoint_storage_invalid",
        422,
        "Checkpoint storage is not a normalised absolute path inside an allowed root.",
    )
    checkpoint_storage_unwritable = (
        "checkpoint_storage_unwritable",
        422,
        "The backend could not create a probe file in the checkpoint storage.",
    )
    budget_exceeded = (
        "budget_exceeded",
        422,
        "The estimated cost exceeds the manifest's budget.ceiling_usd.",
    )
    incremental_cost_exceeded = (
        "incremental_cost_exceeded",
        422,
        "The estimated cost beyond the booking's remaining term exceeds "
        "budget.max_incremental_cost_usd.",
    )
    # --- planner refusals (stages.parallelism) ----------------------------------------
    plan_out_of_memory = (
        "plan_out_of_memory",
        422,
        "Planner: no layout fits GPU memory with these degrees.",
    )
    plan_tp_across_nodes = (
        "plan_tp_across_nodes",
        422,
        "Planner: tensor parallelism would span nodes.",
    )
    plan_tp_beyond_nvlink = (
        "plan_tp_beyond_nvlink",
        422,
        "Planner: tensor parallelism exceeds the NVLink domain.",
    )
    plan_heads_not_divisible = (
        "plan_heads_not_divisible",
        422,
        "Planner: attention heads are not divisible by the TP degree.",
    )
    plan_pp_layers_unbalanced = (
        "plan_pp_layers_unbalanced",
        422,
        "Planner: layers do not split evenly over pipeline stages.",
    )
    plan_pp_bubble_too_large = (
        "plan_pp_bubble_too_large",
        422,
        "Planner: the pipeline bubble is too large for the micro-batch count.",
    )
    plan_objective_unsupported = (
        "plan_objective_unsupported",
        422,
        "The training objective (sft, dpo) cannot run with this layout (pipeline or "
        "context parallel): those stay language-model pretraining only.",
    )
    plan_batch_not_divisible = (
        "plan_batch_not_divisible",
        422,
        "Planner: the global batch does not divide over data-parallel ranks and micro-batches.",
    )
    plan_fp8_unsupported = (
        "plan_fp8_unsupported",
        422,
        "Planner: fp8 requested on a GPU without fp8.",
    )
    plan_degrees_mismatch = (
        "plan_degrees_mismatch",
        422,
        "Planner: the product of the degrees is not the number of GPUs.",
    )
    plan_wasteful = (
        "plan_wasteful",
        422,
        "Planner: the layout would waste GPUs or throughput beyond the allowed margin.",
    )
    plan_no_feasible = (
        "plan_no_feasible",
        422,
        "Planner: no feasible layout exists for this model on this booking.",
    )
    plan_resize_no_group = (
        "plan_resize_no_group",
        422,
        "Planner: the booking grew, but the GPUs it gained hold no whole replica group more "
        "(the layout inside each group stays as planned); the run keeps its groups.",
    )
    plan_resize_batch_not_divisible = (
        "plan_resize_batch_not_divisible",
        422,
        "Planner: the booking grew and holds more whole replica groups, but the run's fixed "
        "global batch does not split evenly over the larger data-parallel width (nor over any "
        "width between); the run keeps its groups.",
    )
    plan_sync_invalid = (
        "plan_sync_invalid",
        422,
        "The replica groups' sync pinned in the manifest is incoherent: every_step with an "
        "interval, diloco with H < 2 or fragments that do not split H, or an H that the "
        "checkpoint interval or a phase's steps are not a multiple of.",
    )
    # --- data prep (stages.data_prep) -------------------------------------------------
    data_not_found = "data_not_found", 422, "Data prep: a data reference does not exist."
    data_remote_not_cached = (
        "data_remote_not_cached",
        422,
        "Data prep: a remote data reference is not cached locally.",
    )
    data_format_unsupported = (
        "data_format_unsupported",
        422,
        "Data prep: the data format is not jsonl, parquet or text.",
    )
    data_digest_mismatch = (
        "data_digest_mismatch",
        422,
        "The bytes of a data ref, post-training dataset or `post_training.base_model` differ "
        "from the sha256 the manifest names; the run fails before any of it is trained on.",
    )
    data_digest_placeholder = (
        "data_digest_placeholder",
        422,
        "A post-training dataset's `sha256` is a placeholder (one digit repeated, e.g. all "
        "zeros): it would pin nothing.",
    )
    data_empty = "data_empty", 422, "Data prep: nothing left to train on (empty, or all removed)."
    eval_suite_unknown = (
        "eval_suite_unknown",
        422,
        "Data prep: an eval suite named for decontamination is unknown.",
    )
    # --- training engine / runtime ----------------------------------------------------
    driver_lost = "driver_lost", 500, "Runtime: the run's driver actor disappeared."
    driver_not_authorized = (
        "driver_not_authorized",
        403,
        "Runtime: a driver reported for a run it does not own.",
    )
    checkpoint_not_found = (
        "checkpoint_not_found",
        404,
        "Runtime: the checkpoint to resume from does not exist.",
    )
    checkpoint_corrupt = "checkpoint_corrupt", 500, "Runtime: a checkpoint failed to load."
    checkpoint_untrusted = (
        "checkpoint_untrusted",
        422,
        "Runtime: a checkpoint's files do not match the seal this backend wrote at save "
        "(tampered, planted, or sealed with another key); nothing of it was unpickled.",
    )
    checkpoint_foreign = (
        "checkpoint_foreign",
        422,
        "Runtime: a checkpoint sealed by this backend for another run or account (or "
        "another step or phase than its folder and records claim) sits in this run's "
        "checkpoint root; it is refused, nothing of it was unpickled.",
    )
    checkpoint_seal_outdated = (
        "checkpoint_seal_outdated",
        422,
        "Runtime: a checkpoint carries a seal of an older format, which does not bind it "
        "to its run; it is refused (re-save it with this backend to keep it).",
    )
    all_replica_groups_lost = (
        "all_replica_groups_lost",
        500,
        "Runtime: every replica group was lost at once.",
    )
    training_failed = "training_failed", 500, "Runtime: training failed."
    resize_refused = (
        "resize_refused",
        409,
        "Runtime: the trainer cannot apply a resize of its replica groups (an objective "
        "other than pretraining's, a global batch that does not split over the new groups, "
        "no live group to heal from); the run keeps its groups.",
    )
    stage_failed = "stage_failed", 500, "Runtime: a pipeline stage failed."
    gate_failed = (
        "gate_failed",
        422,
        "Runtime: a stage's gate other than an eval battery failed (e.g. the data-prep ladder "
        "probe rejected the data); the run fails and is never overridden. A curriculum battery's "
        "failure is `eval_gate_failed`.",
    )
    ray_unavailable = "ray_unavailable", 503, "Runtime: the Ray cluster is not reachable."
    lease_lost = (
        "lease_lost",
        503,
        "Runtime: a supervisor's write came after its leader lease passed to another "
        "replica (fenced); the new leader carries on.",
    )
    store_unavailable = (
        "store_unavailable",
        503,
        "The store (SQLite file or PostgreSQL) cannot be reached or did not answer within its "
        "timeouts; any route may answer it, with `Retry-After`, and `/readyz` answers it until "
        "the store is back (service resumes without a restart).",
    )
    # --- placement (runs on their booking's nodes) ------------------------------------
    booking_nodes_unavailable = (
        "booking_nodes_unavailable",
        503,
        "Placement: no live node marked with the run's booking (or too few of them) joined within"
        " the placement wait.",
    )
    placement_timeout = (
        "placement_timeout",
        503,
        "Placement: the booking's nodes are live but could not be reserved for the run in time "
        "(another run of the booking holds them, or they are smaller than booked).",
    )
    # --- tenant isolation and bounds --------------------------------------------------
    path_outside_root = (
        "path_outside_root",
        422,
        "A data, eval-file, cache or checkpoint reference is not inside the account's "
        "operator-configured roots (absolute path elsewhere, `..`, a symlink, another host in "
        "`file://`, another tenant's folder, the server's own files). The message names only the "
        "manifest field: never a path, digest or whether anything exists.",
    )
    path_not_local = (
        "path_not_local",
        422,
        "A manifest path field is not an absolute local path or `file:///` URI: a relative "
        "path, a hub id (`org/model`, `hf://...`) or another scheme. Nothing is resolved or "
        "fetched.",
    )
    plan_time_budget_exceeded = (
        "plan_time_budget_exceeded",
        422,
        "Planner: the layout search did not finish within the server's time budget "
        "(`Settings.plan_time_budget_s`); nothing was planned.",
    )
    account_disabled = (
        "account_disabled",
        401,
        "The key's account was disabled by the operator (`ito-backend accounts disable`); its "
        "keys and the confirmations its keys made no longer work.",
    )
    # --- curriculum, eval batteries, HF formats (stages.evals, stages.hf) -------------
    eval_battery_unknown = (
        "eval_battery_unknown",
        422,
        "Curriculum: a phase names an eval battery with no configs/evals/<battery>.json.",
    )
    eval_metric_unknown = (
        "eval_metric_unknown",
        422,
        "Curriculum: a gate threshold names a metric its phase's battery does not produce.",
    )
    curriculum_invalid = (
        "curriculum_invalid",
        422,
        "Curriculum: the phases are inconsistent (e.g. a long_context phase that does not raise "
        "the sequence length, or a seq_len beyond the model's positions).",
    )
    eval_gate_failed = (
        "eval_gate_failed",
        422,
        "Runtime: a curriculum phase's eval battery failed its gate (a bound missed, or an eval "
        "that crashed, timed out or gave no number); the run fails and nothing overrides it. "
        "`gate_failed` stays the code of the other stage gates (the data-prep ladder probe).",
    )
    tokenizer_invalid = (
        "tokenizer_invalid",
        422,
        "The tokenizer folder named by the manifest is missing or unusable, or its vocabulary "
        "does not fit the model.",
    )
    model_checkpoint_invalid = (
        "model_checkpoint_invalid",
        422,
        "The HF checkpoint folder named by `model.checkpoint_path` (inside the account's "
        "roots) is missing or has no `config.json`.",
    )
    layout_unsupported = (
        "layout_unsupported",
        422,
        "Trainer: the layout cannot run on the target device (context parallel or fp8 without "
        "CUDA, fp8 below H100).",
    )
    # --- post-training (stages.post_training) -----------------------------------------
    post_training_data_invalid = (
        "post_training_data_invalid",
        422,
        "Post-training: a dataset is not valid conversational (SFT), preference (DPO) or "
        "prompt/answer (RLVR) JSONL; the message names the line and field.",
    )
    post_training_model_invalid = (
        "post_training_model_invalid",
        422,
        "Post-training: the base model is not a local HF folder with config, weights and a "
        "tokenizer with a chat template (or no pretraining export exists).",
    )
    reward_unknown = (
        "reward_unknown",
        422,
        "Post-training: the manifest names a reward function that is not in the registry.",
    )
    rollout_gpus_insufficient = (
        "rollout_gpus_insufficient",
        422,
        "Post-training: RLVR's rollout workers generate on GPUs of their own, "
        "ceil(rollout_workers / node_count) of each booked node's; they would leave the trainer "
        "no GPU.",
    )
    rollout_fleet_failed = (
        "rollout_fleet_failed",
        500,
        "Post-training: the rollout fleet could not produce samples (workers not ready or not "
        "restarted within their timeouts).",
    )


_INCOMPLETE = [c.value for c in ErrorCode if not (400 <= c.http_status <= 599 and c.meaning)]
if _INCOMPLETE:
    raise TypeError(f"error codes without an HTTP status or meaning: {_INCOMPLETE}")


_MARKDOWN_HEAD = """\
# Error codes

<!-- Generated from stages/errors.py: python -m stages.errors --markdown > docs/errors.md -->

Every failure is an envelope `{"ok": false, "live_api_contacted": ..., "notice": ...,
"error": {"code", "message"}}`. `code` is one of `stages.errors.ErrorCode` below; codes
are never renamed or reused. Client-side codes come with `live_api_contacted: false` (the
server was never asked); their HTTP column says what the server would answer if one ever
reached it. Runtime, placement and post-training codes appear as a run's `state_reason` or
a stage's `error_code`, not as HTTP answers.

| code | HTTP | meaning |
|---|---|---|
"""


def markdown_table() -> str:
    """docs/errors.md, in enum order."""
    rows = [f"| `{c.value}` | {c.http_status} | {c.meaning} |" for c in ErrorCode]
    return _MARKDOWN_HEAD + "\n".join(rows) + "\n"


class ItoError(Exception):
    """An error with a stable code and a message that is safe to show a tenant."""

    def __init__(self, code: ErrorCode, message: str, *, details: dict[str, object] | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details or {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.errors")
    parser.add_argument("--markdown", action="store_true", help="print docs/errors.md")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table(), end="")
    else:
        for c in ErrorCode:
            print(f"{c.value}\t{c.http_status}")


if __name__ == "__main__":
    main()
