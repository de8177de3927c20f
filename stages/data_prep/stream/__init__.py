"""Streaming data prep: block-by-block dedup, decontamination and filtering that run in
one process or on Ray Data with the same code and the same result (see
docs/data_prep.md, "At corpus scale")."""

from stages.data_prep.stream.config import StreamConfig
from stages.data_prep.stream.executor import Executor, LocalExecutor, RayDataExecutor
from stages.data_prep.stream.plan import Plan, input_files, make_plan
from stages.data_prep.stream.run import Progress, StreamResult, run_stream

__all__ = ["Executor", "LocalExecutor", "Plan", "Progress", "RayDataExecutor", "StreamConfig",
           "StreamResult", "input_files", "make_plan", "run_stream"]
