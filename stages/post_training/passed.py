"""The record of a post-training objective whose gate passed, beside its HF export.

A relaunched driver runs the stage again from the top; an objective with a record and
an intact export is not trained again: its metrics, battery and export are read back
and the chain goes on from that export. An objective without one (the driver died
during it) trains again, and the engine resumes it from its newest checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from stages.atomic_write import write_text
from stages.errors import ItoError

RECORD_DIR = "passed"


class PassedObjective(BaseModel):
    metrics: dict[str, float]
    hf_model_dir: str
    battery: dict[str, Any] | None = None  # a BatteryResult as JSON


def _path(out: Path, objective: str) -> Path:
    return out / RECORD_DIR / f"{objective}.json"


def save_passed(out: Path, objective: str, record: PassedObjective) -> None:
    path = _path(out, objective)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, record.model_dump_json())


def load_passed(out: Path, objective: str) -> PassedObjective | None:
    """The objective's record if it has one and its export is still a whole HF folder."""
    from stages.post_training.hf_io import check_model_dir

    path = _path(out, objective)
    if not path.is_file():
        return None
    record = PassedObjective.model_validate_json(path.read_bytes())
    export = Path(record.hf_model_dir)
    try:
        check_model_dir([p.relative_to(export).as_posix() for p in export.rglob("*")])
    except ItoError:
        return None
    return record
