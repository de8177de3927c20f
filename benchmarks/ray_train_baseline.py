"""The peer baseline of ``benchmarks/fault_tolerance.py``: Ray Train V2 (``TorchTrainer``
with ``FailureConfig(max_failures=...)``) on the same model, global batch, sequence
length and optimizer, with the same kill and the same lost-time accounting.

Ray Train used as its docs recommend for fault tolerance: DDP over ``prepare_model``
(gloo on cpu, NCCL on cuda), a checkpoint reported through ``ray.train.report`` every
``checkpoint_every`` steps (the production interval) with the asynchronous upload
(``CheckpointUploadMode.ASYNC``), and ``ray.train.get_checkpoint()`` to resume. On
cpu each worker's process (every thread, gloo's included) is pinned to its own core,
as the torchft groups are. When a worker dies, Ray Train restarts the whole worker
group, which resumes from the newest reported checkpoint and redoes the steps since.

Each kill SIGKILLs worker rank 1 at a step drawn uniformly within a checkpoint
interval, after the first checkpoint (``fault_tolerance.restart_kill_steps``).
Measured per kill, from worker rank 0's step log (one line per step: step, time):

- ``detect_s``: kill -> the Train controller's ``UserCallback.after_exception`` (it
  learned that the worker group failed);
- ``restart_s``: kill -> the new worker group's training function started;
- ``back_s``: kill -> the step reached before the kill committed again;
- ``lost_token_s``: over the window from the last step before the kill to
  ``settle_steps`` steps beyond the step reached before it, window seconds minus the
  new tokens (steps beyond that step, each once) valued at the undisturbed rate (the
  median of the last ``warmup_steps`` step gaps before the first kill).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# Seconds to wait for the trainer to reach a step (a restart included).
STEP_TIMEOUT_S = 600.0
POLL_S = 0.05


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: the same llama preset and AdamW as the engine, random
    token batches indexed by step (so a resumed step trains on the same data)."""
    import ray.train
    import ray.train.torch
    import torch

    from stages.model.lm import build_model, causal_lm_loss
    from stages.presets import load_model_preset

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cores = sorted(os.sched_getaffinity(0))
    if config["device"] == "cpu":
        # A core of its own (a dead worker's stays idle); beyond the core count, round
        # robin, as the engine's single-rank groups are (``replica.group_cores``).
        pin_process([cores[rank % len(cores)]])
    torch.set_num_threads(1)
    logs = Path(config["log_dir"])
    (logs / f"pid{rank}").write_text(str(os.getpid()))
    if rank == 0:
        with (logs / "starts.log").open("a") as f:
            f.write(f"{time.time()}\n")
    preset = load_model_preset(config["preset"])
    model = ray.train.torch.prepare_model(build_model(preset, seed=config["seed"]))
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=True)
        _inner(model).load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    device = ray.train.torch.get_device()
    per_rank = config["batch_tokens"] // config["seq_len"] // world
    step_log = (logs / "steps.log").open("a") if rank == 0 else None
    for step in range(start, config["max_steps"]):
        if _stop_requested(logs, world):
            break
        gen = torch.Generator().manual_seed(step * world + rank)
        ids = torch.randint(0, preset.vocab_size, (per_rank, config["seq_len"]), generator=gen)
        opt.zero_grad(set_to_none=True)
        causal_lm_loss(model, ids.to(device)).backward()
        opt.step()
        done = step + 1
        if step_log is not None:
            step_log.write(f"{done} {time.time()} {world}\n")
            step_log.flush()
        if done % config["checkpoint_every"] == 0:
            ckpt_dir = logs / f"ckpt-{done}-rank{rank}"
            checkpoint = None
            if rank == 0:
                # A step redone after a restart saves again where its first pass did.
                ckpt_dir.mkdir(exist_ok=True)
                torch.save(
                    {
                        "model": _inner(model).state_dict(),
                        "optimizer": opt.state_dict(),
                        "step": done,
                    },
                    ckpt_dir / "state.pt",
                )
                checkpoint = ray.train.Checkpoint.from_directory(str(ckpt_dir))
            ray.train.report(
                {"step": done},
                checkpoint=checkpoint,
                checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                delete_local_checkpoint_after_upload=True,
            )


def pin_process(cores: list[int]) -> None:
    """Every thread of this process onto ``cores``, as the device it stands for runs
    its collectives. ``sched_setaffinity(0)`` moves only the calling thread, and Ray
    Train runs the training function in a thread of its own after the worker made its
    process group, so gloo's threads would stay free to use the other worker's core
    (the engine's rank pins before it makes any: they inherit its core)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)


def _stop_requested(logs: Path, world: int) -> bool:
    """Whether every rank stops before this step: the stop file as rank 0 sees it,
    broadcast. Each rank reading the file itself let one leave while its peer went on
    into the step's gradient all-reduce and waited there (gloo's 30 min timeout), so
    ``fit`` hung until the caller's join gave up."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([float((logs / "stop").exists())])
    if world > 1:
        dist.broadcast(flag, src=0)
    return bool(flag.item())


def _inner(model: Any) -> Any:
    """The model inside ``prepare_model``'s DDP wrapper (none with one worker)."""
    return getattr(model, "module", model)


def _wait_line(path: Path, index: int, what: str) -> float:
    """The time written on line ``index`` of ``path``, once it is there."""
    deadline = time.time() + STEP_TIMEOUT_S
    while time.time() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) > index:
            return float(lines[index])
        time.sleep(POLL_S)
    raise TimeoutError(f"ray train: no {what} within {STEP_TIMEOUT_S:.0f}s")


class DetectionLog:
    """A Ray Train callback (it runs in the Train controller): the time at which the
    controller learned that a worker failed, one line per failure."""

    def __init__(self, path: Path):
        self.path = path

    def callback(self) -> Any:
        from ray.train import UserCallback

        path = self.path

        class _Detected(UserCallback):  # type: ignore[misc]
            def after_exception(self, run_context: Any, worker_exceptions: Any) -> None:
                with path.open("a") as f:
                    f.write(f"{time.time()}\n")

        return _Detected()

    def times(self) -> list[float]:
        if not self.path.exists():
            return []
        return [float(x) for x in self.path.read_text().splitlines() if x.strip()]


class StepLog:
    """Worker rank 0's step log, read back as (step, time) rows (``sized_rows``: with the
    worker group's size that trained the step)."""

    def __init__(self, path: Path):
        self.path = path

    def rows(self) -> list[tuple[int, float]]:
        return [(step, ts) for step, ts, _ in self.sized_rows()]

    def sized_rows(self) -> list[tuple[int, float, int]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:  # a line being written is skipped until it is whole
                out.append((int(parts[0]), float(parts[1]), int(parts[2])))
        return out

    def wait(self, pred: Any, what: str) -> tuple[int, float]:
        deadline = time.time() + STEP_TIMEOUT_S
        while time.time() < deadline:
            for row in self.rows():
                if pred(row):
                    return row
            time.sleep(POLL_S)
        raise TimeoutError(f"ray train: no {what} within {STEP_TIMEOUT_S:.0f}s")


class Run:
    """One ``TorchTrainer.fit()`` of ``train_loop`` in a background thread of the caller's
    Ray session, with its step log, its failure log and a stop switch."""

    def __init__(self, logs: Path, detected: DetectionLog):
        self.logs = logs
        self.detected = detected
        self.log = StepLog(logs / "steps.log")
        self.errors: list[BaseException] = []
        self._thread: threading.Thread | None = None

    @classmethod
    def start(
        cls,
        *,
        preset: str,
        workers: int,
        seq_len: int,
        batch_tokens: int,
        lr: float,
        checkpoint_every: int,
        max_failures: int,
        device: str,
        scaling: Any = None,
    ) -> Run:
        """``scaling``: a ``ScalingConfig`` in place of ``workers`` fixed workers of one
        CPU each (``benchmarks/elastic.py``'s elastic range)."""
        import ray
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        # Run as a script, this module is not importable on Ray's workers: ship its code.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        tmp = Path(tempfile.mkdtemp(prefix="ito-raytrain-"))
        logs = tmp / "logs"
        logs.mkdir()
        detected = DetectionLog(logs / "detected.log")
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={
                "preset": preset,
                "seed": 0,
                "lr": lr,
                "seq_len": seq_len,
                "batch_tokens": batch_tokens,
                "checkpoint_every": checkpoint_every,
                "max_steps": 1_000_000,
                "log_dir": str(logs),
                "device": device,
            },
            scaling_config=scaling
            or ScalingConfig(
                num_workers=workers, use_gpu=device == "cuda", resources_per_worker={"CPU": 1}
            ),
            run_config=RunConfig(
                name="ray-train-baseline",
                storage_path=str(tmp / "storage"),
                failure_config=FailureConfig(max_failures=max_failures),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
                callbacks=[detected.callback()],
            ),
        )
        run = cls(logs, detected)

        def fit() -> None:
            try:
                trainer.fit()
            except BaseException as e:  # reported with the figures
                run.errors.append(e)

        run._thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
        run._thread.start()
        return run

    def steady_rate(self, warmup_steps: int, measure_steps: int) -> tuple[float, float]:
        """(seconds per step, global-batch steps per second) over ``measure_steps``
        consecutive steps after ``warmup_steps``, checkpoint steps included (a plain
        loop pays its saves too)."""
        a = self.log.wait(lambda r: r[0] >= warmup_steps, "warm-up steps")
        b = self.log.wait(lambda r: r[0] >= a[0] + measure_steps, "measured steps")
        step_s = (b[1] - a[1]) / (b[0] - a[0])
        return step_s, 1.0 / step_s

    def kill_worker(self, rank: int) -> bool:
        """SIGKILL the worker of ``rank`` (False: it was already gone, e.g. restarting)."""
        try:
            os.kill(int((self.logs / f"pid{rank}").read_text()), signal.SIGKILL)
            return True
        except (ProcessLookupError, FileNotFoundError, ValueError):
            return False

    def churn(self, every_s: float, duration_s: float, batch_tokens: int) -> dict[str, float]:
        """SIGKILL worker rank 1 every ``every_s`` seconds for ``duration_s``; tokens of
        the steps beyond the one reached at the start, each step number once (a step redone
        after a restart adds nothing), committed within the window."""
        t0 = time.time()
        beyond = max((r[0] for r in self.log.rows() if r[1] <= t0), default=0)
        kills = 0
        while (t_next := t0 + (kills + 1) * every_s) < t0 + duration_s:
            time.sleep(max(0.0, t_next - time.time()))
            kills += self.kill_worker(1)
        time.sleep(max(0.0, t0 + duration_s - time.time()))
        end = t0 + duration_s
        new = {r[0] for r in self.log.rows() if t0 < r[1] <= end and r[0] > beyond}
        return {"kills": kills, "tokens_per_s": len(new) * batch_tokens / duration_s}

    def stop(self) -> None:
        (self.logs / "stop").write_text("")
        if self._thread is not None:
            self._thread.join(timeout=120)


def measure(
    *,
    preset: str,
    workers: int,
    seq_len: int,
    batch_tokens: int,
    lr: float,
    checkpoint_every: int,
    kill_steps: list[int],
    warmup_steps: int,
    settle_steps: int,
    device: str,
) -> dict[str, Any]:
    """Ray Train V2's figures for a kill at each of ``kill_steps``, in the caller's Ray
    session."""
    run = Run.start(
        preset=preset,
        workers=workers,
        seq_len=seq_len,
        batch_tokens=batch_tokens,
        lr=lr,
        checkpoint_every=checkpoint_every,
        max_failures=len(kill_steps) + 1,
        device=device,
    )
    logs, detected, log = run.logs, run.detected, run.log
    results: list[dict[str, float]] = []
    try:
        log.wait(lambda r: r[0] >= warmup_steps + 1, "warm-up steps")
        rows = log.rows()
        gaps = [b[1] - a[1] for a, b in itertools.pairwise(rows) if b[0] == a[0] + 1]
        step_s = statistics.median(gaps[-warmup_steps:])
        tok_rate = batch_tokens / step_s
        for kill_at in kill_steps:
            log.wait(lambda r, k=kill_at: r[0] >= k, f"step {kill_at}")
            starts_before = len((logs / "starts.log").read_text().splitlines())
            detected_before = len(detected.times())
            t_kill = time.time()
            os.kill(int((logs / f"pid{min(1, workers - 1)}").read_text()), signal.SIGKILL)
            done = [r for r in log.rows() if r[1] <= t_kill]
            reached = max(r[0] for r in done)
            start_ts = max(r[1] for r in done)
            # Only the restarted worker group's steps count: the old rank 0 may still log
            # a step it finished as the kill landed (lost with it: not checkpointed).
            restarted = _wait_line(logs / "starts.log", starts_before, "the restarted group")
            back = log.wait(
                lambda r, s=reached, t=restarted: r[1] > t and r[0] >= s, "pre-kill step"
            )
            end = log.wait(
                lambda r, s=reached, t=restarted: r[1] > t and r[0] >= s + settle_steps,
                "steps after the pre-kill step",
            )
            starts = [float(x) for x in (logs / "starts.log").read_text().splitlines()]
            new = {r[0] for r in log.rows() if restarted < r[1] <= end[1] and r[0] > reached}
            lost = (end[1] - start_ts) - len(new) * batch_tokens / tok_rate
            seen = detected.times()
            results.append(
                {
                    "reached": reached,
                    "detect_s": seen[detected_before] - t_kill
                    if len(seen) > detected_before
                    else float("nan"),
                    "restart_s": starts[starts_before] - t_kill
                    if len(starts) > starts_before
                    else float("nan"),
                    "back_s": back[1] - t_kill,
                    "lost_token_s": max(0.0, lost),
                }
            )
            r = results[-1]
            print(
                f"ray train kill at step {reached}: detect {r['detect_s']:.2f}s, "
                f"restarted after {r['restart_s']:.2f}s, "
                f"back at it after {r['back_s']:.2f}s, lost {r['lost_token_s']:.2f}s (tokens)",
                flush=True,
            )
    finally:
        run.stop()

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in results), 3) if results else float("nan")

    return {
        "ray_train_kills": len(results),
        "ray_train_detect_s_median": med("detect_s"),
        "ray_train_restart_s_median": med("restart_s"),
        "ray_train_back_s_median": med("back_s"),
        "ray_train_lost_token_s_median": med("lost_token_s"),
        "ray_train_step_ms": round(step_s * 1000, 1),
        "ray_train_error": repr(run.errors[0])[:200] if run.errors else None,
    }
