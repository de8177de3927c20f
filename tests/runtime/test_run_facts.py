"""The run's facts as one typed record: built by the supervisor, carried in the signed
launch spec, read by the driver's stages by field; the wire keeps the dict's keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launch_specs import signed_spec
from helpers.manifests import example_manifest
from helpers.store_rows import insert_run
from helpers.tenants import booking_doc, make_tenant
from pydantic import ValidationError

from orchestrator.db.store import Store
from orchestrator.runtime import launch
from orchestrator.runtime.driver import RunDriverImpl
from orchestrator.runtime.driver_lifecycle import launch_spec
from orchestrator.runtime.launch import LaunchSpec
from orchestrator.runtime.supervisor_settings import SupervisorSettings
from stages.checkpointing.seal import run_binding
from stages.run_facts import BookingTopology, PlacementFact, RunFacts

PLACEMENT = PlacementFact(
    booking_id="bk_1",
    resource="booking:bk_1",
    placement_group="run-run_1-pg",
    placement_group_id="ab" * 18,
    bundles=2,
    bundle={"booking:bk_1": 2.0},
)
# The facts as a supervisor that built them as a plain dict sent them.
DICT_FACTS = {
    "booking": {
        "gpu_sku": "cpu-testbed",
        "gpus_per_node": 2,
        "node_count": 1,
        "region": "local",
        "fabric": "loopback",
    },
    "train_overrides": {"pace_step_s": 0.1},
    "data_roots": ["/data/acme"],
    "model_roots": ["/data/acme", "/ckpt/acme"],
    "placement": PLACEMENT.model_dump(),
}


@pytest.fixture(autouse=True)
def _launch_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    key = tmp_path / "launch.key"
    monkeypatch.setenv(launch.LAUNCH_KEY_ENV, str(key))
    launch.ensure_launch_key(key)
    return key


def test_the_dict_a_driver_receives_is_validated_once_into_typed_fields(tmp_path: Path) -> None:
    wire = signed_spec(tmp_path, facts=DICT_FACTS).model_dump()
    spec = LaunchSpec.model_validate(wire)
    launch.verify(spec)  # the facts are not part of the MAC: the ticket still holds
    facts = spec.facts
    assert facts.booking == BookingTopology(**DICT_FACTS["booking"])  # type: ignore[arg-type]
    assert facts.placement == PLACEMENT
    assert facts.data_roots == ("/data/acme",)
    assert facts.model_roots == ("/data/acme", "/ckpt/acme")
    assert facts.train_overrides == {"pace_step_s": 0.1}
    assert facts.device == "cpu"
    assert facts.account == "acme"  # the signed spec's


def test_the_wire_keeps_the_facts_dict_keys(tmp_path: Path) -> None:
    """What a driver reads off the wire is keyed as the facts' dict was (the same
    values under the same names), so drivers of either shape read the other's spec."""
    facts = signed_spec(tmp_path, facts=DICT_FACTS).model_dump()["facts"]
    for key, value in DICT_FACTS.items():
        got = facts[key]
        assert (list(got) if isinstance(got, tuple) else got) == value, key
    assert facts["account"] == "acme"


def test_a_stage_seals_for_the_signed_account_whatever_the_facts_claim(tmp_path: Path) -> None:
    wire = signed_spec(tmp_path, facts=DICT_FACTS).model_dump()
    wire["facts"]["account"] = "mallory"  # outside the MAC: a tampered spec
    driver = RunDriverImpl(wire, use_ray_metrics=False)
    assert driver.ctx.facts.account == "acme"
    assert run_binding("run_1", driver.ctx.facts).account == "acme"


def test_an_unknown_or_mistyped_fact_is_refused() -> None:
    with pytest.raises(ValidationError):
        RunFacts.model_validate({"placemnet": PLACEMENT.model_dump()})
    with pytest.raises(ValidationError):
        RunFacts.model_validate({"device": "tpu"})
    with pytest.raises(ValidationError):
        RunFacts.model_validate({"placement": {"booking_id": "bk_1"}})


def test_the_booking_is_its_topology_and_a_missing_field_stays_missing() -> None:
    row = {"booking_id": "bk_1", "account_id": "acme", "gpu_sku": "cpu-testbed"}
    booking = BookingTopology.model_validate(row)
    assert booking.as_dict() == {"gpu_sku": "cpu-testbed"}  # the planner names what lacks
    assert RunFacts().booking.as_dict() == {}


def test_the_launch_spec_trains_on_cuda_where_the_reservation_holds_gpus(tmp_path: Path) -> None:
    """The supervisor's spec takes the run's device from its reservation: cuda where its
    bundles hold the booked nodes' GPUs, cpu on the testbed or before any placement."""
    db = tmp_path / "ito.db"
    make_tenant(db, "acme", booking=booking_doc("bk_1", "acme"))
    store = Store(db)
    try:
        account_id = store.account_by_name("acme")["account_id"]  # type: ignore[index]
        manifest = example_manifest(tmp_path / "ckpt")
        insert_run(store, "run_1", account_id=account_id, booking_id="bk_1", manifest=manifest)
        (run,) = store.read("SELECT * FROM runs WHERE run_id = ?", ("run_1",))

        def device(placed: PlacementFact | None) -> str:
            spec = launch_spec(
                store,
                run,
                var_dir=tmp_path / "var",
                settings=SupervisorSettings(),
                attempt=1,
                placed=placed,
            )
            return spec.facts.device

        on_gpus = {"booking:bk_1": 8.0, "CPU": 96.0, "GPU": 8.0}
        assert device(PLACEMENT.model_copy(update={"bundle": on_gpus})) == "cuda"
        assert device(PLACEMENT) == "cpu"
        assert device(None) == "cpu"
    finally:
        store.close()
