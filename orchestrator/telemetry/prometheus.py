"""Prometheus exposition of run and booking telemetry (served by the metrics listener,
orchestrator/telemetry/listener.py, never on the API socket).

A custom collector computes the families at scrape time from the store, so the
numbers a scrape shows are exactly what ``ito metrics`` shows. Labels are
``run_id`` and ``booking_id`` (never ``job``: Prometheus renames it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from orchestrator.db.store import Store
from orchestrator.telemetry.goodput import RunMetrics, aggregate
from orchestrator.telemetry.metrics_view import RunSample, samples

# Post-training's rollout-fleet gauges: (RunMetrics.post_training key, family, help).
POST_TRAINING_GAUGES = (
    (
        "rollout_samples_per_s",
        "ito_run_rollout_samples_per_second",
        "RLVR rollout samples (completions) generated per second",
    ),
    (
        "trainer_idle_frac",
        "ito_run_rl_trainer_idle_ratio",
        "Fraction of RLVR wall time the trainer waited for rollouts",
    ),
    (
        "rollout_idle_frac",
        "ito_run_rl_rollout_idle_ratio",
        "Fraction of rollout-worker time not generating",
    ),
    (
        "weight_sync_s",
        "ito_run_rl_weight_sync_seconds",
        "Median seconds to publish a policy version to every rollout worker",
    ),
    ("staleness_min", "ito_run_rl_staleness_min", "Fewest policy versions a trained sample lagged"),
    ("staleness_mean", "ito_run_rl_staleness_mean", "Mean policy versions a trained sample lagged"),
    ("staleness_max", "ito_run_rl_staleness_max", "Most policy versions a trained sample lagged"),
    (
        "drop_rate",
        "ito_run_rl_dynamic_sampling_drop_ratio",
        "Fraction of rollout groups dropped by dynamic sampling (uniform rewards)",
    ),
    ("mean_reward", "ito_run_rl_mean_reward", "Mean verifiable reward of the last RLVR step"),
)


class TelemetryCollector(Collector):
    def __init__(self, source: Callable[[], Iterable[RunSample]]):
        self._source = source

    def collect(self) -> Iterator[Metric]:
        samples = list(self._source())
        labels = ["run_id", "booking_id"]
        goodput = GaugeMetricFamily(
            "ito_run_goodput_ratio", "Productive step time / elapsed time", labels=labels
        )
        elapsed = GaugeMetricFamily(
            "ito_run_elapsed_seconds", "Seconds since the run started", labels=labels
        )
        badput = GaugeMetricFamily(
            "ito_run_badput_seconds", "Non-productive seconds by cause", labels=[*labels, "cause"]
        )
        interruptions = CounterMetricFamily(
            "ito_run_interruptions", "Replica-group or job interruptions", labels=labels
        )
        ilabels = [*labels, "interruption", "kind"]
        i_detect = GaugeMetricFamily(
            "ito_run_interruption_detect_seconds",
            "Seconds from a failure to its detection",
            labels=ilabels,
        )
        i_recover = GaugeMetricFamily(
            "ito_run_interruption_recover_seconds",
            "Seconds from a failure to training in the full quorum again",
            labels=ilabels,
        )
        rate = GaugeMetricFamily(
            "ito_run_interruption_rate_per_hour",
            "Interruptions per hour of elapsed time",
            labels=labels,
        )
        ckpt_bw = GaugeMetricFamily(
            "ito_run_checkpoint_bandwidth_bytes_per_second",
            "Checkpoint bytes / total save seconds",
            labels=labels,
        )
        tps = GaugeMetricFamily(
            "ito_run_tokens_per_second", "Committed tokens per second", labels=labels
        )
        steps = CounterMetricFamily(
            "ito_run_steps_committed", "Committed optimizer steps", labels=labels
        )
        state = GaugeMetricFamily(
            "ito_run_state", "1 for the run's current state", labels=[*labels, "state"]
        )
        plabels = [*labels, "stage", "step"]
        p_docs = GaugeMetricFamily(
            "ito_run_stage_progress_documents",
            "Documents done in the stage's current step",
            labels=plabels,
        )
        p_docs_total = GaugeMetricFamily(
            "ito_run_stage_progress_documents_total",
            "Documents the stage's current step goes through",
            labels=plabels,
        )
        p_bytes = GaugeMetricFamily(
            "ito_run_stage_progress_bytes",
            "Input bytes done in the stage's current step",
            labels=plabels,
        )
        p_eta = GaugeMetricFamily(
            "ito_run_stage_progress_eta_seconds",
            "Estimated seconds left of the stage's current step",
            labels=plabels,
        )
        evals = GaugeMetricFamily(
            "ito_run_eval_score",
            "Score of one check of a curriculum phase's eval battery",
            labels=[*labels, "phase", "check"],
        )
        groups = GaugeMetricFamily(
            "ito_run_replica_groups",
            "The run's replica groups: its plan's, then each applied resize's to its booking "
            "(0: paused for capacity)",
            labels=labels,
        )
        resize_s = GaugeMetricFamily(
            "ito_run_resize_seconds",
            "Seconds from a booking change to the first step with the new group count",
            labels=[*labels, "request_id", "groups_before", "groups_after"],
        )
        gpu_hours = GaugeMetricFamily(
            "ito_run_gpu_hours",
            "GPU-hours the run used at the group counts it had since its first step",
            labels=labels,
        )
        rl = {
            key: GaugeMetricFamily(name, doc, labels=labels)
            for key, name, doc in POST_TRAINING_GAUGES
        }
        by_booking: dict[str, list[RunMetrics]] = defaultdict(list)
        for s in samples:
            lv = [s.run_id, s.booking_id]
            m = s.metrics
            goodput.add_metric(lv, m.goodput)
            elapsed.add_metric(lv, m.elapsed_s)
            for cause, secs in m.badput_s.items():
                badput.add_metric([*lv, cause], secs)
            interruptions.add_metric(lv, m.interruptions)
            rate.add_metric(lv, m.interruption_rate_per_h)
            for t in m.interruption_timings:
                il = [*lv, str(t.index), t.kind]
                if t.detect_s is not None:
                    i_detect.add_metric(il, t.detect_s)
                if t.recover_s is not None:
                    i_recover.add_metric(il, t.recover_s)
            ckpt_bw.add_metric(lv, m.checkpoint_bytes_per_s)
            tps.add_metric(lv, m.tokens_per_s)
            steps.add_metric(lv, m.steps_committed)
            state.add_metric([*lv, s.state], 1.0)
            p = m.stage_progress
            if p:
                pl = [*lv, str(p.get("stage") or ""), str(p.get("step") or "")]
                p_docs.add_metric(pl, float(p.get("docs_done") or 0))
                p_docs_total.add_metric(pl, float(p.get("docs_total") or 0))
                p_bytes.add_metric(pl, float(p.get("bytes_done") or 0))
                if p.get("eta_s") is not None:
                    p_eta.add_metric(pl, float(p["eta_s"]))
            scores = {(e["phase"], e["check"]): e["score"] for e in m.eval_scores}
            for (phase, check), score in scores.items():  # a re-scored check: the last
                evals.add_metric([*lv, phase, check], score)
            if m.replica_groups is not None:
                groups.add_metric(lv, m.replica_groups)
            for r in m.resizes:
                if r.seconds is not None and r.action in ("applied", "paused"):
                    rs = [*lv, r.request_id, str(r.groups_before), str(r.groups_after)]
                    resize_s.add_metric(rs, r.seconds)
            if m.gpu_hours is not None:
                gpu_hours.add_metric(lv, m.gpu_hours)
            for key, value in m.post_training.items():
                if key in rl:
                    rl[key].add_metric(lv, value)
            by_booking[s.booking_id].append(m)
        b_goodput = GaugeMetricFamily(
            "ito_booking_goodput_ratio",
            "Pooled goodput of the booking's runs",
            labels=["booking_id"],
        )
        b_rate = GaugeMetricFamily(
            "ito_booking_interruption_rate_per_hour",
            "Interruptions per hour over the booking's runs",
            labels=["booking_id"],
        )
        b_bw = GaugeMetricFamily(
            "ito_booking_checkpoint_bandwidth_bytes_per_second",
            "Checkpoint bandwidth over the booking's runs",
            labels=["booking_id"],
        )
        b_tps = GaugeMetricFamily(
            "ito_booking_tokens_per_second",
            "Committed tokens per second over the booking's runs",
            labels=["booking_id"],
        )
        for booking_id, runs in by_booking.items():
            agg = aggregate(runs)
            b_goodput.add_metric([booking_id], agg.goodput)
            b_rate.add_metric([booking_id], agg.interruption_rate_per_h)
            b_bw.add_metric([booking_id], agg.checkpoint_bytes_per_s)
            b_tps.add_metric([booking_id], agg.tokens_per_s)
        yield from (
            goodput,
            elapsed,
            badput,
            interruptions,
            i_detect,
            i_recover,
            rate,
            ckpt_bw,
            tps,
            steps,
            state,
            p_docs,
            p_docs_total,
            p_bytes,
            p_eta,
            evals,
            groups,
            resize_s,
            gpu_hours,
            b_goodput,
            b_rate,
            b_bw,
            b_tps,
        )
        yield from rl.values()


def render(store: Store) -> tuple[bytes, str]:
    """The whole scrape: run counts, gate failures, and per-run and per-booking goodput
    telemetry (docs/runtime.md)."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

    from orchestrator.runs import RunState

    registry = CollectorRegistry()
    runs = Gauge("ito_runs", "Runs by state", ["state"], registry=registry)
    counts = {
        r["state"]: r["n"]
        for r in store.read("SELECT state, COUNT(*) AS n FROM runs GROUP BY state")
    }
    for state in RunState:
        runs.labels(state=str(state)).set(counts.get(str(state), 0))
    fails = Gauge(
        "ito_gate_failures",
        "Gate failures by code (since the store was created)",
        ["code"],
        registry=registry,
    )
    for r in store.read(
        "SELECT code, CAST(SUM(count) AS BIGINT) AS n FROM audit_events "
        "WHERE outcome = 'fail' GROUP BY code"
    ):
        fails.labels(code=str(r["code"])).set(r["n"])
    registry.register(TelemetryCollector(lambda: samples(store)))
    return generate_latest(registry), CONTENT_TYPE_LATEST
