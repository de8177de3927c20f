"""lm-evaluation-harness tasks on an in-memory model: ``evaluate`` with ``HFLM``.

The battery's task YAMLs name their data files relative to their own folder; they
are materialised into a private include folder with absolute paths (the vendored
bytes are what the gate records by sha256). Offline: the hub is never contacted.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:  # the driver decides gates here; the ranks run the model
    import torch
    from transformers import PreTrainedTokenizerBase

_OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def task_data_files(task_yaml: Path) -> list[Path]:
    """The data files a task YAML reads, absolute."""
    spec = yaml.safe_load(task_yaml.read_text())
    files = (spec.get("dataset_kwargs") or {}).get("data_files") or {}
    values = files.values() if isinstance(files, dict) else [files]
    out: list[Path] = []
    for v in values:
        for f in v if isinstance(v, list) else [v]:
            p = Path(f)
            out.append(p if p.is_absolute() else (task_yaml.parent / p).resolve())
    return out


def materialise(task_yaml: Path, include_dir: Path) -> str:
    """Copy a task YAML into ``include_dir`` with absolute data paths; its task name."""
    spec = yaml.safe_load(task_yaml.read_text())
    kwargs = spec.setdefault("dataset_kwargs", {})
    files = kwargs.get("data_files") or {}
    kwargs["data_files"] = {
        split: str(p if Path(p).is_absolute() else (task_yaml.parent / p).resolve())
        for split, p in files.items()
    }
    include_dir.mkdir(parents=True, exist_ok=True)
    (include_dir / task_yaml.name).write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(spec["task"])


def preload() -> None:
    """Import lm-evaluation-harness and the HF model class its ``HFLM`` is handed
    (``stages.hf.view``) ahead of the first battery (seconds on a loaded host: a
    trainer rank does it while it waits for the run's data, not at the first phase's
    end, where the whole fleet would wait)."""
    for k, v in _OFFLINE.items():
        os.environ.setdefault(k, v)
    import lm_eval  # noqa: F401
    from lm_eval.models.huggingface import HFLM  # noqa: F401
    from lm_eval.tasks import TaskManager  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401


def run_tasks(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    task_yamls: list[Path],
    *,
    include_dir: Path,
    max_length: int,
    batch_size: int = 8,
    limit: int | None = None,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Run the tasks; returns ``{task: {"<metric>,<filter>": value}}``."""
    for k, v in _OFFLINE.items():
        os.environ.setdefault(k, v)
    import numpy as np
    import torch
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from stages.hf.view import as_hf

    model = as_hf(model)  # HFLM needs transformers' class; the view shares the weights
    names = [materialise(t, include_dir) for t in task_yamls]
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    device = next(model.parameters()).device
    was_training = model.training
    model.train(False)  # eval mode: transformers' (unannotated) eval() is this call
    try:
        lm = HFLM(
            pretrained=model,
            tokenizer=tokenizer,
            device=str(device),
            batch_size=batch_size,
            max_length=max_length,
        )
        # ``evaluate`` with ``simple_evaluate``'s seeding and task set-up, not
        # ``simple_evaluate`` itself: that also records the host (``pip list``, torch's
        # collect_env, ``git``), a second and more per battery that the gate never reads.
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        loaded = TaskManager(include_path=str(include_dir), include_defaults=False).load(names)
        for task in loaded["tasks"].values():
            if task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=seed)
        out = evaluate(lm=lm, task_dict=loaded, limit=limit, log_samples=False, bootstrap_iters=0)
    finally:
        model.train(was_training)
    if out is None:
        return {}
    results: dict[str, dict[str, Any]] = out["results"]
    return {
        task: {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        for task, metrics in results.items()
    }
