"""``ito``: the tenant's command line over the canonical client (docs/cli.md).

With ``--json`` every invocation prints exactly one envelope on stdout and nothing
else, whatever happens (usage error, refused manifest, lost server, revoked key,
a bug). Without it, a readable form goes to stdout and errors to stderr. The exit
status says what kind of outcome it was (``EXIT_*`` below, documented in
docs/cli.md). The API key is never a flag; it comes from ``ITO_API_KEY`` or the
credentials file, and is scrubbed from anything printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from orchestrator.client import human
from orchestrator.client.api import (
    TERMINAL_STATES,
    ClientSettings,
    Envelope,
    ItoClient,
    check_api_url,
    error_code,
    error_envelope,
    ok_envelope,
)
from orchestrator.client.credentials import REDACTED, ApiKey, load_api_key, redact
from orchestrator.client.manifest_reader import ManifestBytes, read_manifest
from orchestrator.redact import looks_secret
from stages.errors import ErrorCode, ItoError

API_URL_ENV = "ITO_API_URL"

EXIT_OK = 0
EXIT_INTERNAL = 1  # a bug in the client; the envelope says internal_error
EXIT_USAGE = 2  # bad arguments (argparse's convention)
EXIT_REFUSED = 3  # refused locally before any request (manifest, credentials, config)
EXIT_SERVER_ERROR = 4  # the server answered with an error envelope
EXIT_TRANSPORT = 5  # no usable answer: unreachable, timeout, ambiguous failure
EXIT_AUTH = 6  # credential revoked or not accepted: stopped, no login attempted
EXIT_RUN_UNSUCCESSFUL = 7  # --follow ended with the run failed or cancelled
EXIT_INTERRUPTED = 130

_AUTH_CODES = {ErrorCode.credential_revoked, ErrorCode.unauthenticated,
               ErrorCode.account_disabled}
_TRANSPORT_CODES = {
    ErrorCode.api_unreachable,
    ErrorCode.api_timeout,
    ErrorCode.ambiguous_transport_failure,
    ErrorCode.payload_too_large,
}


def exit_code_for(env: Envelope) -> int:
    if env.get("ok"):
        return EXIT_OK
    code = error_code(env)
    if code in _AUTH_CODES:
        return EXIT_AUTH
    if env.get("live_api_contacted"):
        return EXIT_SERVER_ERROR
    if code in _TRANSPORT_CODES:
        return EXIT_TRANSPORT
    if code == ErrorCode.internal_error:
        return EXIT_INTERNAL
    return EXIT_REFUSED


class _UsageError(Exception):
    pass


# Options nobody should pass (``ito`` takes no secret on its command line) whose value
# must still never be echoed by a usage error: --api-key, --token, --password, ...
_SECRET_OPTION = re.compile(r"^--?[\w-]*(api[-_]?key|token|secret|passw|credential|auth)",
                            re.IGNORECASE)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """argv with every secret-looking value replaced, before argparse sees it (so no
    usage error can print one): values of secret-named options (``--api-key K`` and
    ``--api-key=K``) and any argument shaped like a key or token."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif _SECRET_OPTION.match(arg):
            name, eq, _ = arg.partition("=")
            out.append(f"{name}={REDACTED}" if eq else arg)
            hide_next = not eq
        elif looks_secret(arg):
            out.append(REDACTED)
        else:
            out.append(arg)
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _common() -> _Parser:
    p = _Parser(add_help=False)
    p.add_argument("--json", action="store_true", help="print exactly one JSON envelope")
    p.add_argument("--api-url", help=f"server URL (default: ${API_URL_ENV})")
    p.add_argument("--connect-timeout", type=float, default=None, metavar="S")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="total per request")
    return p


def _mutation(p: argparse.ArgumentParser) -> None:
    p.add_argument("--confirmation-ref", required=True)
    p.add_argument("--idempotency-key", required=True)


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = _Parser(prog="ito", description="ito-train client (docs/cli.md)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help_)

    p = add("train", "submit a confirmed run")
    p.add_argument("--booking", required=True)
    p.add_argument("--manifest", required=True)
    _mutation(p)
    p = add("plan", "validate, estimate cost and plan; creates nothing")
    p.add_argument("--booking", required=True)
    p.add_argument("--manifest", required=True)
    for name, help_ in (("status", "show a run"), ("logs", "show a run's logs")):
        p = add(name, help_)
        p.add_argument("--run", required=True)
        p.add_argument("--follow", action="store_true")
        p.add_argument("--poll-interval", type=float, default=None, metavar="S")
        if name == "logs":
            p.add_argument("--cursor", default=None)
            p.add_argument("--limit", type=int, default=None)
    for name in ("metrics", "checkpoints"):
        add(name, f"show a run's {name}").add_argument("--run", required=True)
    p = add("find", "find the run submitted under an idempotency key (after exit 5)")
    p.add_argument("--idempotency-key", required=True)
    add("eligibility", "the booking's fresh eligibility").add_argument("--booking", required=True)
    for name in ("cancel", "cleanup"):
        p = add(name, f"{name} a run (needs its own confirmation)")
        p.add_argument("--run", required=True)
        _mutation(p)
    for name in ("approve", "decline"):
        p = add(name, f"{name} a run's proposal")
        p.add_argument("--run", required=True)
        p.add_argument("--proposal", required=True)
        _mutation(p)
    p = add("release", "release a booking (an economic action, separately confirmed)")
    p.add_argument("--booking", required=True)
    _mutation(p)
    p = add("confirm", "the approver: make a one-time confirmation reference")
    p.add_argument(
        "--action", required=True, choices=["train", "cancel", "cleanup", "release", "restart"]
    )
    p.add_argument("--booking", required=True)
    p.add_argument("--manifest")
    p.add_argument("--run")
    p.add_argument("--proposal")
    p.add_argument("--cost-usd", type=float, default=None)
    p.add_argument("--ttl-s", type=int, default=None)
    p = sub.add_parser("manifest", help="write a manifest for review (never submits)")
    msub = p.add_subparsers(dest="manifest_command", required=True, parser_class=_Parser)
    p = msub.add_parser("init", parents=[common], help="the short form as a full manifest, "
                        "with the server's plan and cost; never submits")
    p.add_argument("--booking", required=True)
    p.add_argument("--model-size", required=True, help="e.g. 8B, 70B, 150M")
    p.add_argument("--data", required=True, help="a local file or folder, or file:// URI")
    p.add_argument("--target", required=True, help="capability: an eval suite, e.g. gsm8k")
    p.add_argument("--budget-usd", required=True, type=float)
    p.add_argument("--post-training", choices=["sft", "dpo", "rlvr"], default=None)
    p.add_argument("--output", default=None,
                   help="where to write it (default ./ito-manifest-<booking>.json)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="checkpoints go under DIR/<name> (default: the account's first "
                        "checkpoint root, from the server)")
    return parser


# --- readable output -------------------------------------------------------------------


def _fmt_run(run: dict[str, Any]) -> str:
    lines = [
        f"run {run.get('run_id')}  state={run.get('state')}"
        + (f" ({run['state_reason']})" if run.get("state_reason") else ""),
        f"  booking={run.get('booking_id')} manifest={run.get('manifest_id')} "
        f"key={run.get('idempotency_key')} cost_estimate_usd={run.get('cost_estimate_usd')}",
    ]
    prog = _progress(run)
    if prog:
        lines.append(f"  {prog}")
    sp = run.get("stage_progress")
    if isinstance(sp, dict) and sp.get("step"):
        lines.append(f"  {_fmt_stage_progress(sp)}")
    for g in run.get("stage_gates") or []:
        lines.append(f"  gate {g.get('stage')}: {g.get('status')} {g.get('reason') or ''}".rstrip())
    for eg in run.get("eval_gates") or []:
        lines.append(f"  eval gate {eg.get('phase')} ({eg.get('battery')}, step "
                     f"{eg.get('step')}): {'passed' if eg.get('passed') else 'FAILED'}")
        for ch in eg.get("checks") or []:
            lines.append(f"    {'ok  ' if ch.get('passed') else 'FAIL'} {ch.get('check')} = "
                         f"{ch.get('score')}  ({ch.get('reason')})")
    for pr in run.get("proposals") or []:
        lines.append(
            f"  proposal {pr.get('proposal_id')} [{pr.get('status')}] {pr.get('action')}: "
            f"{pr.get('description')}"
        )
    if run.get("replayed"):
        lines.append("  (replayed: this idempotency key already named this run)")
    return "\n".join(lines)


def _find(d: dict[str, Any], *names: str) -> Any:
    for scope in (d, d.get("progress"), d.get("training"), d.get("metrics")):
        if isinstance(scope, dict):
            for n in names:
                if scope.get(n) is not None:
                    return scope[n]
    return None


def _progress(run: dict[str, Any]) -> str:
    step = _find(run, "step", "last_step", "global_step")
    loss = _find(run, "loss", "last_loss")
    parts = []
    if step is not None:
        parts.append(f"step={step}")
    if isinstance(loss, int | float):
        parts.append(f"loss={loss:.4f}")
    return " ".join(parts)


def _fmt_stage_progress(p: dict[str, Any]) -> str:
    """One line: stage step (i/n): tasks, documents, MB, ETA."""
    eta = p.get("eta_s")
    mb_done = (p.get("bytes_done") or 0) / 1e6
    mb_total = (p.get("bytes_total") or 0) / 1e6
    return (f"{p.get('stage')} {p.get('step')} ({int(p.get('step_index') or 0) + 1}/"
            f"{p.get('steps')}): {p.get('tasks_done')}/{p.get('tasks_total')} tasks, "
            f"{p.get('docs_done')}/{p.get('docs_total')} documents, "
            f"{mb_done:.1f}/{mb_total:.1f} MB"
            + (f", eta {_fmt_eta(float(eta))}" if isinstance(eta, int | float) else ""))


def _fmt_eta(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else \
        f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _fmt_log(e: dict[str, Any]) -> str:
    ts = e.get("ts")
    when = time.strftime("%H:%M:%S", time.gmtime(ts)) if isinstance(ts, int | float) else str(ts)
    return f"{when} {e.get('level', ''):<7} {e.get('stage') or '-':<14} {e.get('message', '')}"


def _fmt_plan(d: dict[str, Any]) -> str:
    lines = [
        f"manifest {d.get('manifest_id')} (sha256 {d.get('manifest_digest')})",
        f"  booking {d.get('booking_id')}: cost estimate "
        f"{human.value('cost_estimate_usd', d.get('cost_estimate_usd'))}"
        + (f", incremental {human.value('incremental_cost_usd', d['incremental_cost_usd'])}"
           if "incremental_cost_usd" in d else ""),
    ]
    for name, result in (d.get("validation") or {}).items():
        shown = (
            result
            if not isinstance(result, dict)
            else ", ".join(f"{k}={human.value(k, v)}" for k, v in result.items()
                           if not isinstance(v, dict | list))
        )
        lines.append(f"  {name}: {shown}")
    plan = d.get("plan")
    lines.append("  plan: " + (json.dumps(plan, sort_keys=True) if plan else "none yet"))
    for ph in ((d.get("validation") or {}).get("curriculum") or {}).get("phases") or []:
        gates = ", ".join(f"{g.get('metric')}" + "".join(
            f" {k}={g[k]}" for k in ("min", "max", "max_regression") if k in g)
            for g in ph.get("gates") or []) or "every check must run"
        lines.append(f"  phase {ph.get('name')} ({ph.get('kind')}): steps {ph.get('steps')}, "
                     f"{ph.get('token_budget')} tokens, seq_len {ph.get('seq_len')}, "
                     f"battery {ph.get('battery')} [{gates}]")
    return "\n".join(lines)


def _readable(command: str, data: dict[str, Any]) -> str:
    if command == "plan":
        return _fmt_plan(data)
    if command in ("train", "status", "cancel", "approve", "decline") and "run_id" in data:
        return _fmt_run(data)
    if command == "logs":
        return "\n".join(_fmt_log(e) for e in data.get("entries") or [])
    if command == "find":
        runs = data.get("runs") or []
        return "\n".join(_fmt_run(r) for r in runs) or "no run for this idempotency key"
    if command == "confirm":
        return str(data.get("confirmation_ref"))
    if command == "manifest":
        from orchestrator.client.manifest_init import readable

        return readable(data)
    if command == "checkpoints":
        rows = [
            f"step {c.get('step')}: {human.value('bytes', c.get('bytes'))}, blocking "
            f"{human.value('blocking_s', c.get('blocking_s'))}, total "
            f"{human.value('total_s', c.get('total_s'))}, "
            f"{human.value('bytes_per_s', c.get('bytes_per_s'))}  {c.get('path')}"
            + (f"  [phase {c['phase']}{', closes it' if c.get('closes_phase') else ''}]"
               if c.get("phase") else "")
            for c in data.get("checkpoints") or []
        ]
        return "\n".join(rows) or "no checkpoints"
    if command == "metrics":
        return "\n".join(f"{k}: {human.value(k, v)}" for k, v in data.items())
    if command == "cleanup":
        run = data.get("run") or {}
        return (
            f"run {run.get('run_id')} state={run.get('state')}: removed "
            f"{len(data.get('removed') or [])} paths, "
            f"{human.value('bytes_removed', data.get('bytes_removed'))}; "
            f"booking untouched={data.get('booking_untouched')}"
        )
    return json.dumps(data, indent=2, sort_keys=True)


class _Out:
    """All printing goes through here, so the key is scrubbed from every byte."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.secret: str | None = None

    def _write(self, stream: Any, text: str) -> None:
        stream.write(redact(text, self.secret) + "\n")
        stream.flush()

    def progress(self, text: str) -> None:
        if not self.as_json:
            self._write(sys.stdout, text)

    def final(self, command: str, env: Envelope) -> None:
        if self.as_json:
            self._write(sys.stdout, json.dumps(env, default=str))
            return
        if env.get("ok"):
            if command == "confirm":
                d = env["data"]
                self._write(
                    sys.stderr,
                    f"confirmation for {d.get('action')} on booking {d.get('booking_id')}: "
                    f"cost {human.value('cost_usd', d.get('cost_usd'))}, "
                    f"expires_at={d.get('expires_at')}",
                )
            text = _readable(command, env["data"])
            if text:
                self._write(sys.stdout, text)
            if env.get("notice"):
                self._write(sys.stderr, f"note: {env['notice']}")
        else:
            err = env.get("error") or {}
            where = "server" if env.get("live_api_contacted") else "client"
            self._write(sys.stderr, f"error [{err.get('code')}] ({where}): {err.get('message')}")
            if env.get("notice"):
                self._write(sys.stderr, f"note: {env['notice']}")


# --- commands --------------------------------------------------------------------------


def _manifest(args: argparse.Namespace) -> ManifestBytes:
    # Read once, before any request (run_cli); every later use sends these bytes.
    mb: ManifestBytes = args.manifest_bytes
    return mb


def _cmd_follow_status(client: ItoClient, args: argparse.Namespace, out: _Out) -> Envelope:
    last_line: list[str] = [""]

    def on_update(env: Envelope) -> None:
        if not env.get("ok"):
            return
        run = env["data"]
        line = f"state={run.get('state')} {_progress(run)}".rstrip()
        if line != last_line[0]:
            last_line[0] = line
            out.progress(f"{time.strftime('%H:%M:%S')} run {run.get('run_id')} {line}")

    return client.follow_status(args.run, on_update, with_progress=not out.as_json)


def _cmd_follow_logs(client: ItoClient, args: argparse.Namespace, out: _Out) -> Envelope:
    collected: list[dict[str, Any]] = []

    def on_entries(entries: list[dict[str, Any]]) -> None:
        if out.as_json:
            collected.extend(entries)
        else:
            for e in entries:
                out.progress(_fmt_log(e))

    env = client.follow_logs(args.run, on_entries, cursor=args.cursor)
    if not env.get("ok"):
        return env
    run = env["data"]
    data = {
        "run_id": run.get("run_id"),
        "state": run.get("state"),
        "entries": collected,
        "next_cursor": run.get("next_cursor"),
    }
    return ok_envelope(data, notice=env.get("notice", ""))


def _cmd_confirm(client: ItoClient, args: argparse.Namespace) -> Envelope:
    manifest = _manifest(args) if args.manifest else None
    if args.action == "train" and manifest is None:
        raise ItoError(ErrorCode.bad_request, "confirm --action train needs --manifest")
    if args.action in ("cancel", "cleanup", "restart") and not args.run:
        raise ItoError(ErrorCode.bad_request, f"confirm --action {args.action} needs --run")
    if args.action == "restart" and not args.proposal:
        raise ItoError(ErrorCode.bad_request, "confirm --action restart needs --proposal")
    cost = args.cost_usd
    if cost is None and args.action == "train":
        assert manifest is not None
        plan = client.plan(args.booking, manifest)  # the server's estimate is the default
        if not plan.get("ok"):
            return plan
        cost = plan["data"].get("cost_estimate_usd")
        if not isinstance(cost, int | float):
            raise ItoError(
                ErrorCode.bad_request, "the server gave no cost estimate; pass --cost-usd"
            )
    return client.confirm(
        args.action,
        args.booking,
        cost_usd=float(cost or 0.0),
        manifest=manifest,
        run_id=args.run,
        proposal_id=args.proposal,
        ttl_s=args.ttl_s,
    )


def _dispatch(client: ItoClient, args: argparse.Namespace, out: _Out) -> Envelope:
    c = args.command
    if c == "train":
        return client.train(
            args.booking, _manifest(args), args.confirmation_ref, args.idempotency_key
        )
    if c == "plan":
        return client.plan(args.booking, _manifest(args))
    if c == "status":
        return _cmd_follow_status(client, args, out) if args.follow else client.run(args.run)
    if c == "logs":
        if args.follow:
            return _cmd_follow_logs(client, args, out)
        return client.logs(args.run, cursor=args.cursor, limit=args.limit)
    if c == "metrics":
        return client.metrics(args.run)
    if c == "find":
        return client.find_run_by_key(args.idempotency_key)
    if c == "eligibility":
        return client.eligibility(args.booking)
    if c == "checkpoints":
        return client.checkpoints(args.run)
    if c == "cancel":
        return client.cancel(args.run, args.confirmation_ref, args.idempotency_key)
    if c == "cleanup":
        return client.cleanup(args.run, args.confirmation_ref, args.idempotency_key)
    if c in ("approve", "decline"):
        return client.decide(
            args.run, args.proposal, c, args.confirmation_ref, args.idempotency_key
        )
    if c == "release":
        return client.release(args.booking, args.confirmation_ref, args.idempotency_key)
    if c == "confirm":
        return _cmd_confirm(client, args)
    if c == "manifest":
        from orchestrator.client.manifest_init import run_init

        return run_init(client, args)
    raise ItoError(ErrorCode.bad_request, f"unknown command {c!r}")


def _settings(args: argparse.Namespace) -> ClientSettings:
    update: dict[str, float] = {}
    for name in ("connect_timeout", "timeout", "poll_interval"):
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            flag = "--" + name.replace("_", "-")
            raise ItoError(ErrorCode.bad_request, f"{flag} must be a positive number of seconds")
    if args.connect_timeout is not None:
        update["connect_timeout_s"] = args.connect_timeout
    if args.timeout is not None:
        update["total_timeout_s"] = args.timeout
    if getattr(args, "poll_interval", None) is not None:
        update["poll_interval_s"] = args.poll_interval
    return ClientSettings(**update)


def run_cli(
    argv: Sequence[str], *, client_factory: Callable[..., ItoClient] = ItoClient
) -> tuple[int, Envelope]:
    """Parse, run and print; returns (exit status, the envelope printed)."""
    as_json = "--json" in argv
    out = _Out(as_json)
    key: ApiKey | None = None
    command = argv[0] if argv else ""
    if as_json and ("-h" in argv or "--help" in argv):
        # Help is text; under --json it travels inside the one envelope.
        parser = build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        target = sub.choices.get(command, parser)
        env = ok_envelope({"help": target.format_help()}, live_api_contacted=False)
        out.final(command, env)
        return EXIT_OK, env
    try:
        try:
            args = build_parser().parse_args(redact_argv(argv))
        except _UsageError as exc:
            env = error_envelope(ErrorCode.bad_request, f"usage: {exc}")
            out.final(command, env)
            return EXIT_USAGE, env
        command = args.command
        try:
            # Local checks first, in this order: nothing below touches the network
            # until the manifest, the URL and the key have all been accepted.
            args.manifest_bytes = None
            if getattr(args, "manifest", None) is not None:  # "" is refused, not skipped
                args.manifest_bytes = read_manifest(args.manifest)
            api_url = args.api_url or os.environ.get(API_URL_ENV, "")
            if not api_url:
                raise ItoError(
                    ErrorCode.bad_request, f"no server URL: pass --api-url or set {API_URL_ENV}"
                )
            try:
                api_url = check_api_url(api_url)
            except ValueError as exc:
                raise ItoError(ErrorCode.bad_request, str(exc)) from None
            settings = _settings(args)
            key = load_api_key()
            out.secret = key.reveal()
            with client_factory(api_url, key, settings=settings) as client:
                env = _dispatch(client, args, out)
        except ItoError as exc:
            env = error_envelope(exc.code, exc.message)
    except KeyboardInterrupt:
        env = error_envelope(ErrorCode.bad_request, "interrupted")
        out.final(command, env)
        return EXIT_INTERRUPTED, env
    except Exception as exc:  # the one-envelope promise holds even for a client bug
        env = error_envelope(ErrorCode.internal_error, f"client error: {type(exc).__name__}")
    out.final(command, env)
    status = exit_code_for(env)
    if (
        status == EXIT_OK
        and command == "status"
        and getattr(args, "follow", False)
        and env["data"].get("state") in TERMINAL_STATES - {"succeeded", "cleaned"}
    ):
        status = EXIT_RUN_UNSUCCESSFUL
    return status, env


def main(argv: Sequence[str] | None = None) -> int:
    status, _ = run_cli(sys.argv[1:] if argv is None else argv)
    return status


if __name__ == "__main__":
    sys.exit(main())
