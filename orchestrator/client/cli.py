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
import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TextIO

from orchestrator.client import human, render
from orchestrator.client.api import TERMINAL_STATES, ItoClient
from orchestrator.client.credentials import REDACTED, ApiKey, load_api_key, redact
from orchestrator.client.envelope import Envelope, error_code, error_envelope, ok_envelope
from orchestrator.client.interrupt import stop_on_sigint
from orchestrator.client.manifest_reader import ManifestBytes, read_manifest
from orchestrator.client.transport import ClientSettings, check_api_url
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

_AUTH_CODES = {ErrorCode.credential_revoked, ErrorCode.unauthenticated, ErrorCode.account_disabled}
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
_SECRET_OPTION = re.compile(
    r"^--?[\w-]*(api[-_]?key|token|secret|passw|credential|auth)", re.IGNORECASE
)


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
    p = msub.add_parser(
        "init",
        parents=[common],
        help="the short form as a full manifest, with the server's plan and cost; never submits",
    )
    p.add_argument("--booking", required=True)
    p.add_argument("--model-size", required=True, help="e.g. 8B, 70B, 150M")
    p.add_argument("--data", required=True, help="a local file or folder, or file:// URI")
    p.add_argument("--target", required=True, help="capability: an eval suite, e.g. gsm8k")
    p.add_argument("--budget-usd", required=True, type=float)
    p.add_argument("--post-training", choices=["sft", "dpo", "rlvr"], default=None)
    p.add_argument(
        "--output", default=None, help="where to write it (default ./ito-manifest-<booking>.json)"
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="checkpoints go under DIR/<name> (default: the account's first "
        "checkpoint root, from the server)",
    )
    return parser


class _Out:
    """All printing goes through here, so the key is scrubbed from every byte."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.secret: str | None = None

    def _write(self, stream: TextIO, text: str) -> None:
        if not self.as_json:  # JSON escapes control characters itself
            text = human.safe_lines(text)
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
                    f"confirmation for {human.safe(d.get('action'))} on booking "
                    f"{human.safe(d.get('booking_id'))}: "
                    f"cost {human.value('cost_usd', d.get('cost_usd'))}, "
                    f"expires_at={human.safe(d.get('expires_at'))}",
                )
            text = render.readable(command, env["data"])
            if text:
                self._write(sys.stdout, text)
            if env.get("notice"):
                self._write(sys.stderr, f"note: {human.safe(env['notice'])}")
        else:
            err = env.get("error") or {}
            where = "server" if env.get("live_api_contacted") else "client"
            self._write(
                sys.stderr,
                f"error [{human.safe(err.get('code'))}] ({where}): "
                f"{human.safe(err.get('message'))}",
            )
            if env.get("notice"):
                self._write(sys.stderr, f"note: {human.safe(env['notice'])}")


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
        line = f"state={human.safe(run.get('state'))} {render.progress(run)}".rstrip()
        if line != last_line[0]:
            last_line[0] = line
            out.progress(f"{time.strftime('%H:%M:%S')} run {human.safe(run.get('run_id'))} {line}")

    return client.follow_status(args.run, on_update, with_progress=not out.as_json)


def _cmd_follow_logs(client: ItoClient, args: argparse.Namespace, out: _Out) -> Envelope:
    collected: list[dict[str, Any]] = []

    def on_entries(entries: list[dict[str, Any]]) -> None:
        if out.as_json:
            collected.extend(entries)
        else:
            for e in entries:
                out.progress(render.log_entry(e))

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
    with stop_on_sigint() as stop:
        status, _ = run_cli(
            sys.argv[1:] if argv is None else argv,
            client_factory=functools.partial(ItoClient, sleep=stop.sleep),
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
