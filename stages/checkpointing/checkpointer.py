"""Asynchronous DCP checkpointing on a run's checkpoint policy.

The training loop asks ``due(step)`` and calls ``save(step, state)``; a background
thread writes and fsyncs the files while training goes on; the checkpoint is
committed (see ``storage``) once DCP has finished, and older ones beyond ``keep``
are deleted only after that. ``poll()`` hands completed saves to the loop for
``CheckpointEvent``s.

Staging (the copy of the state into CPU buffers that are cached across saves) is
what the loop can block on. With ``async_staging=True`` (the default; torchtitan's
``async_with_pinned_mem``) it runs on a staging thread and ``save`` returns at
once: forward/backward overlap the copy, and a one-shot step pre-hook on the
state's optimizer makes the next ``optimizer.step()`` wait for it, so the saved
state is exactly the state at ``save``. Anything else that mutates the state
in place before the next step (e.g. a torchft heal loading a peer's weights) must
call ``wait_staged()`` first. With ``async_staging=False``, ``save`` returns only
after the copy.

Multi-rank: pass a dedicated gloo ``process_group`` (the save thread runs DCP's
collectives on it, which must not interleave with the training collectives).
The storage folder must be shared by the ranks; group rank 0 commits, deletes
and reports. ``due`` does no collective: with a time interval, ranks must pass
an agreed ``now`` (e.g. rank 0's clock, broadcast by the loop).
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.hooks import RemovableHandle

from stages.checkpointing import seal
from stages.checkpointing.config import CheckpointPolicy
from stages.checkpointing.sealed import describe_failure, load_sealed
from stages.checkpointing.sealing_writer import SealingWriter
from stages.checkpointing.storage import (
    CheckpointRecord,
    commit,
    delete_checkpoint,
    final_name,
    list_checkpoints,
    note_read,
    pinned_phase,
    read_record,
    sweep_incomplete,
    tmp_prefix,
)
from stages.errors import ErrorCode, ItoError

log = logging.getLogger(__name__)
# Single-process saves are intended (no_dist); DCP warns about them on every call.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable", category=UserWarning
)

# How long wait()/save()/close() wait for an in-flight save before failing it.
SAVE_TIMEOUT_S = 1800.0
# DCP writer threads per rank: each writes and hashes files of its own, so the seal's
# BLAKE3 (2.5 GB/s a thread here) runs beside the other's write instead of before it.
# A sealed 1 GB save took 0.90 s with two against 1.15-1.35 s with one (raw disk
# 0.7 s; docs/checkpointing.md).
WRITER_THREADS = 2
# The GIL switch interval while dcp.async_save launches a save. The launch wakes the
# staging thread and starts an upload thread (a new one per save, whose start() waits
# until it runs); at Python's default 5 ms the caller waits a forced switch for each
# hand-back, tens of ms the training step pays. Only the launch runs at this interval.
LAUNCH_SWITCH_INTERVAL_S = 0.0002

StateLike = Stateful | dict[str, Any]


def _as_state_dict(state: StateLike) -> dict[str, Any]:
    """DCP wants a dict at the top level; a bare Stateful is saved under "train"."""
    return state if isinstance(state, dict) else {"train": state}


@dataclass
class _Pending:
    step: int
    tmp_dir: Path
    final_dir: Path
    started: float
    upload: Future[Any]
    staging: Future[Any] | None
    blocking_s: float = 0.0
    staged_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    record: CheckpointRecord | None = None
    error: BaseException | None = None
    hook: RemovableHandle | None = None
    writer: SealingWriter | None = None
    phase: str = ""


class Checkpointer:
    """Async DCP saves with commit-on-complete, keep-last-K and interval policy."""

    def __init__(
        self,
        policy: CheckpointPolicy,
        *,
        process_group: dist.ProcessGroup | None = None,
        run_label: str = "",
        async_staging: bool = True,
        writer_threads: int = WRITER_THREADS,
        save_timeout_s: float = SAVE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        seal_key: bytes | None = None,
        binding: seal.CheckpointBinding | None = None,
    ):
        self.policy = policy
        # The run every save is sealed for and every load must belong to.
        self.binding = binding if binding is not None else seal.CheckpointBinding()
        self.storage_dir = Path(policy.storage_path)
        self.run_label = run_label
        self._pg = process_group
        self._dist = process_group is not None or (dist.is_available() and dist.is_initialized())
        self.rank = dist.get_rank(group=process_group) if self._dist else 0
        self.is_coordinator = self.rank == 0
        if process_group is None and self._dist and dist.get_world_size() > 1:
            log.warning(
                "Checkpointer on the default process group: DCP's save-thread "
                "collectives may interleave with training collectives; pass a "
                "dedicated gloo group"
            )
        self._writer_threads = writer_threads
        self._save_timeout_s = save_timeout_s
        self._clock = clock
        self._last_step = 0  # step 0 is never due: nothing has been trained yet
        self._last_time = clock()
        self._pending: _Pending | None = None
        self._completed: list[CheckpointRecord] = []
        self._lock = threading.Lock()
        self._closed = False
        # Read once, up front: a node without the launch key must fail here, not at
        # the first save an hour in.
        self._seal_key = seal_key if seal_key is not None else seal.seal_key()
        try:
            self.storage_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ItoError(
                ErrorCode.checkpoint_storage_unwritable,
                f"cannot create checkpoint storage: {e.strerror}",
            ) from e
        if self.is_coordinator:
            for p in sweep_incomplete(self.storage_dir, label=run_label):
                log.info("swept incomplete checkpoint %s", p.name)
        self._async_staging = async_staging
        self._stager = self._new_stager()

    def _new_stager(self) -> DefaultStager:
        # Staging buffers are cached across saves (keyed by the source storage), so
        # only the first save pays for allocating them; they cost 1x the state in RAM.
        gpu = torch.cuda.is_available()
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=gpu,
                use_shared_memory=False,
                use_async_staging=self._async_staging,
                use_non_blocking_copy=gpu and self._async_staging,
            )
        )

    def _stager_for_next_save(self) -> DefaultStager:
        """The stager, or a new one where the last save closed it: torch before 2.12
        closes the StateDictStager after every stage (emptying its copy dispatch and
        its buffer cache), so reusing it fails the next save."""
        inner = getattr(self._stager, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            self._stager.close()
            self._stager = self._new_stager()
        return self._stager

    # --- policy ---------------------------------------------------------------------
    def due(self, step: int, now: float | None = None) -> bool:
        """Whether ``step`` (just completed) should be checkpointed."""
        if step <= self._last_step:
            return False
        if self.policy.interval_steps and step % self.policy.interval_steps == 0:
            return True
        if self.policy.interval_minutes is not None:
            t = self._clock() if now is None else now
            return t - self._last_time >= self.policy.interval_minutes * 60.0
        return False

    # --- saving ---------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: StateLike,
        *,
        now: float | None = None,
        guard: torch.optim.Optimizer | None = None,
        phase: str = "",
    ) -> None:
        """Start an async save of ``state`` at ``step`` (of curriculum ``phase``: the
        seal binds the checkpoint to it, with the run and the step).

        Inline staging: returns once the state is copied. Background staging: returns
        at once, and the copy is guarded by a one-shot step pre-hook on ``guard`` (by
        default ``state.optimizer``, e.g. a ``TrainState``'s), so the next
        ``optimizer.step()`` waits for it; with nothing to guard, the copy is awaited
        here. Either way the state may be mutated by the optimizer afterwards."""
        if self._closed:
            raise ItoError(ErrorCode.invalid_state, "checkpointer is closed")
        t0 = time.perf_counter()
        self.wait()  # one save in flight: the staging buffers are reused
        t1 = time.perf_counter()  # this save's own clock (blocking_s also counts the wait)
        self._last_step = step
        self._last_time = self._clock() if now is None else now
        tmp_dir = self.storage_dir / f"{tmp_prefix(self.run_label)}{final_name(step)}"
        final_dir = self.storage_dir / final_name(step)
        if self.is_coordinator and tmp_dir.exists():
            shutil.rmtree(tmp_dir)
        try:
            writer = SealingWriter(tmp_dir, sync_files=True, thread_count=self._writer_threads)
            switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(switch_interval, LAUNCH_SWITCH_INTERVAL_S))
            try:
                result = state_dict_saver.async_save(
                    _as_state_dict(state),
                    storage_writer=writer,
                    async_stager=self._stager_for_next_save(),
                    process_group=self._pg,
                    no_dist=not self._dist,
                )
            finally:
                sys.setswitchinterval(switch_interval)
        except (OSError, CheckpointException) as e:
            raise ItoError(
                ErrorCode.checkpoint_storage_unwritable,
                f"checkpoint save at step {step} failed: {describe_failure(e)}",
            ) from e
        if isinstance(result, Future):
            upload, staging = result, None
        else:
            upload, staging = result.upload_completion, result.staging_completion
        pending = _Pending(
            step=step,
            tmp_dir=tmp_dir,
            final_dir=final_dir,
            started=t1,
            upload=upload,
            staging=staging,
            writer=writer,
            phase=phase,
        )
        pending.blocking_s = time.perf_counter() - t0
        pending.staged_s = time.perf_counter() - t1
        if staging is not None:
            staging.add_done_callback(
                lambda _f: setattr(pending, "staged_s", time.perf_counter() - t1)
            )
        self._pending = pending
        upload.add_done_callback(lambda fut: self._finish(pending, fut))
        if staging is not None:
            guard = guard if guard is not None else getattr(state, "optimizer", None)
            if isinstance(guard, torch.optim.Optimizer):
                pending.hook = guard.register_step_pre_hook(
                    lambda _opt, _args, _kwargs: self._staged_before_step(pending)
                )
            else:
                self.wait_staged()

    def _staged_before_step(self, pending: _Pending) -> None:
        if pending.hook is not None:
            pending.hook.remove()
            pending.hook = None
        if self._pending is pending:
            self.wait_staged()

    def wait_staged(self) -> None:
        """Block until the in-flight save's state copy is complete (background staging;
        a no-op otherwise). Called by the optimizer guard; call it yourself before
        mutating a state in any other way."""
        pending = self._pending
        if pending is None or pending.staging is None or pending.staging.done():
            return
        t0 = time.perf_counter()
        try:
            pending.staging.result(timeout=self._save_timeout_s)
        except FutureTimeoutError as e:  # the copy may still be reading the state
            raise ItoError(
                ErrorCode.checkpoint_storage_unwritable,
                f"checkpoint at step {pending.step}: state copy did not finish in "
                f"{self._save_timeout_s:.0f} s",
            ) from e
        except (Exception, CheckpointException):  # nothing reads the state now; wait() reports
            log.warning("checkpoint at step %d: state copy failed", pending.step)
        finally:
            pending.blocking_s += time.perf_counter() - t0

    def _finish(self, pending: _Pending, upload: Future[Any]) -> None:
        """Runs on the save thread once DCP has written (and fsynced) everything."""
        try:
            upload.result()
            if self.is_coordinator:
                record = CheckpointRecord(
                    step=pending.step,
                    path=str(pending.final_dir),
                    bytes=0,
                    blocking_s=pending.blocking_s,
                    staged_s=pending.staged_s,
                    total_s=time.perf_counter() - pending.started,
                    bytes_per_s=0.0,
                    created_at=time.time(),
                    run_label=self.run_label,
                )
                assert pending.writer is not None
                pending.record = commit(
                    pending.tmp_dir,
                    pending.final_dir,
                    record,
                    self._seal_key,
                    seal.SealBinding(
                        **self.binding.model_dump(), phase=pending.phase, step=pending.step
                    ),
                    pending.writer.file_digests,
                )
                with self._lock:
                    self._completed.append(pending.record)
                self._apply_keep()
        except BaseException as e:  # surfaced to the loop by wait()/poll()
            log.exception("checkpoint save at step %d failed", pending.step)
            pending.error = e
        finally:
            pending.done.set()

    def _apply_keep(self) -> None:
        # Checkpoints that closed a curriculum phase are kept whatever keep-K says.
        records = [
            r for r in list_checkpoints(self.storage_dir) if pinned_phase(r, self._seal_key) is None
        ]
        for old in records[: -self.policy.keep]:
            try:
                delete_checkpoint(old)
            except (OSError, ItoError):
                log.warning("could not delete old checkpoint %s", old.path, exc_info=True)

    def wait(self) -> CheckpointRecord | None:
        """Block until the in-flight save (if any) is committed; its record (None on
        non-coordinator ranks or when nothing was in flight). Raises if it failed."""
        pending = self._pending
        if pending is None:
            return None
        if not pending.done.wait(timeout=self._save_timeout_s):
            raise ItoError(
                ErrorCode.checkpoint_storage_unwritable,
                f"checkpoint save at step {pending.step} did not finish in "
                f"{self._save_timeout_s:.0f} s",
            )
        self._pending = None
        if pending.hook is not None:  # staged long ago; the optimizer never stepped
            pending.hook.remove()
            pending.hook = None
        self._raise_if_failed(pending)
        return pending.record

    @staticmethod
    def _raise_if_failed(pending: _Pending) -> None:
        if pending.error is None:
            return
        e = pending.error
        if isinstance(e, ItoError):
            raise e
        raise ItoError(
            ErrorCode.checkpoint_storage_unwritable,
            f"checkpoint save at step {pending.step} failed: {describe_failure(e)}",
        ) from e

    def poll(self) -> list[CheckpointRecord]:
        """Saves committed since the last poll (oldest first). Raises once if the
        in-flight save failed."""
        pending = self._pending
        if pending is not None and pending.done.is_set() and pending.error is not None:
            self._pending = None
            self._raise_if_failed(pending)
        with self._lock:
            done, self._completed = self._completed, []
        return done

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done.is_set()

    # --- listing and loading ----------------------------------------------------------
    def records(self) -> list[CheckpointRecord]:
        """Complete checkpoints, oldest step first."""
        return list_checkpoints(self.storage_dir)

    def latest(self) -> CheckpointRecord | None:
        records = list_checkpoints(self.storage_dir)
        return records[-1] if records else None

    def load(self, record: CheckpointRecord, state: StateLike) -> None:
        """Load ``record`` into ``state`` in place (the same shape ``save`` was given);
        ``checkpoint_foreign`` when it was sealed for another run or account."""
        path = Path(record.path)
        if read_record(path) is None:
            raise ItoError(ErrorCode.checkpoint_not_found, f"no complete checkpoint at {path.name}")
        note_read(record, self.run_label)
        load_sealed(
            _as_state_dict(state),
            path,
            self._seal_key,
            self.binding,
            process_group=self._pg,
            no_dist=not self._dist,
        )
        self._last_step = record.step
        self._last_time = self._clock()

    def discard_after(self, step: int) -> list[CheckpointRecord]:
        """Delete checkpoints newer than ``step`` (an abandoned timeline, e.g. after an
        approved restart from ``step``), so ``latest()`` never resumes into it."""
        self.wait()
        gone = [r for r in list_checkpoints(self.storage_dir) if r.step > step]
        if self.is_coordinator:
            for r in gone:
                delete_checkpoint(r)
        return gone

    def close(self) -> None:
        """Wait for the in-flight save and release the staging buffers."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._stager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
