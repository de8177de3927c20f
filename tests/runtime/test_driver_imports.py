"""What the run driver imports before it starts the trainer fleet: the fleet's start
(rank processes, imports, model builds) is the long pole before the first step, so
the manifest's models, the pipeline and the plan must not pull in data prep's
dedup (datasketch, scipy: a second of imports on a loaded host), which data prep
imports once the fleet is on its way."""

from __future__ import annotations

from helpers.fresh_python import run_python


def test_the_driver_plans_without_dedups_imports() -> None:
    code = (
        "import json, sys\n"
        "import orchestrator.runtime.driver, orchestrator.runtime.pipeline\n"
        "import orchestrator.gates.manifest, stages.parallelism\n"
        "from stages.data_prep import DataRef, file_sha256\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules}"
        " & {'datasketch', 'scipy', 'torch'})))"
    )
    assert run_python(code) == []
