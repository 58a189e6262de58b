"""The scheduler's placement loop: profile, plan, staff the stages, re-plan on membership changes.

It profiles the model once the workers have joined, plans with the configured planner, tells every
worker its stage (``stage_assign``), and re-plans whenever a worker joins, leaves or is lost;
predictions come from the runtime model (:mod:`hmp.placement.calibration`), calibrated on the
running plan. It talks to the scheduler only through the core's membership and clock, its
``on_membership``/``on_report`` hooks, ``core.fail`` and a ``send`` coroutine. See
docs/pipeline.md and docs/placement.md, "Runtime model and calibration".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hmp.config import Config
from hmp.data import Dataset
from hmp.errors import HmpError
from hmp.messages import StageAssign
from hmp.models import from_config
from hmp.pipeline.assign import StageWorkers, assign_workers, predicted_throughput, runnable
from hmp.pipeline.microbatches import micro_batches_of, total_steps
from hmp.placement import calibration
from hmp.placement.calibration import Calibration, RuntimeCosts, StageLoad, StageMeasurement
from hmp.placement.problem import PlacementProblem, Plan
from hmp.placement.profiler import micro_batch_times, reference_type
from hmp.placement.registry import make_planner, problem_from_config, replan
from hmp.placement.spec import spec_table
from hmp.scheduler.core import SchedulerCore
from hmp.scheduler.membership import NOT_JOINED, UP, MemberState

#: Sends one stage assignment to a worker (the scheduler shell's connection to it).
Send = Callable[[str, StageAssign], Awaitable[Any]]


class PlacementLoop:
    def __init__(self, cfg: Config, dataset: Dataset, core: SchedulerCore, send: Send, log: Any) -> None:
        self.cfg, self.dataset, self.core, self.send = cfg, dataset, core, send
        self.pcfg = cfg.placement
        self.changed = asyncio.Event()
        self.problem: PlacementProblem | None = None  # calibrated figures once a calibration re-planned
        self.profiled_problem: PlacementProblem | None = None  # as profiled
        self.plan: Plan | None = None
        self.stages: list[StageWorkers] = []
        self.plan_id = 0
        self.history: list[dict[str, Any]] = []
        self.latest: dict[str, dict[str, float]] = {}  # worker -> its last report
        self.max_step = 0
        n_train = len(dataset.y_train)
        self.steps = total_steps(self.cfg.train.epochs, n_train, self.cfg.train.batch_size)
        self.first_join: float | None = None
        self.log = log.bind(loop="placement")
        self.micro_times: list[dict[str, float]] = []  # per layer, per type: one micro-batch's fwd+bwd
        self.costs: RuntimeCosts | None = None  # the runtime model's costs (calibrated once a plan ran)
        self.calibrated_plan = 0  # the last plan id calibrated on
        self.replan_calibrated = False  # a calibration asks for a re-plan of the calibrated problem
        self.first_reports: dict[tuple[int, str], dict[str, float]] = {}  # (plan, worker) -> its first report
        self.calibrate = self.pcfg.calibrate

    def resource_of(self, worker_id: str) -> str:
        n = self.cfg.node(worker_id)
        return n.resource or n.role

    # ---------------------------------------------------------------- scheduler hooks
    def on_membership(self, worker_id: str, state: MemberState) -> None:
        """A worker became available (LIVE) or stopped being (LOST, LEFT): re-plan."""
        if state in UP and self.first_join is None:
            self.first_join = time.monotonic()
        self.log.info("membership_changed", worker=worker_id, state=str(state))
        self.changed.set()

    def on_report(self, worker_id: str, metrics: dict[str, float]) -> None:
        self.latest[worker_id] = metrics
        if metrics.get("plan") == self.plan_id:
            self.first_reports.setdefault((self.plan_id, worker_id), metrics)
            self.max_step = max(self.max_step, int(metrics.get("step", 0)))
            if self.calibrate != "off" and self.calibrated_plan != self.plan_id:
                self.try_calibrate()

    @property
    def pipeline_done(self) -> bool:
        return any(m.get("pipeline_done") and m.get("plan") == self.plan_id for m in self.latest.values())

    # ---------------------------------------------------------------- the loop
    def elapsed(self) -> float:
        return self.core.elapsed(time.monotonic())

    async def run(self) -> None:
        x = self.dataset.x_train[: self.cfg.train.batch_size]
        model = from_config(self.cfg)
        # Profile once the workers have joined: while they start (importing torch, loading data) the
        # shared cores are busy and layer times come out inflated and noisy.
        await self.wait_for_workers()
        samples = float(self.cfg.train.epochs * len(self.dataset.y_train))
        try:
            self.problem = self.profiled_problem = await asyncio.to_thread(
                problem_from_config, spec_table(self.cfg, samples), model, x, path=self.cfg.path,
                counts=self.counts(self.live_workers()), name=self.cfg.model.name)
        except (HmpError, ValueError) as exc:
            self.log.error("placement_failed", error=str(exc))
            self.core.fail(f"placement: {exc}")
            return
        try:
            self.micro_times = await asyncio.to_thread(
                micro_batch_times, model, self.problem, x, self.pcfg.micro_batches, reps=self.pcfg.profile_repeats)
        except ValueError as exc:
            self.log.error("placement_failed", error=str(exc))
            self.core.fail(f"placement: {exc}")
            return
        self.costs = RuntimeCosts(cores=calibration.available_cores(), message_s=self.problem.message_overhead_s)
        ref = reference_type(self.problem)
        self.log.info("profiled", reference=ref, layers={lay.name: round(lay.time_s[ref] * 1e3, 4) if ref else None
                                                         for lay in self.problem.layers},
                      micro_batch_ms={lay.name: round(t[ref] * 1e3, 4) if ref else None
                                      for lay, t in zip(self.problem.layers, self.micro_times)})
        while not self.core.over:
            self.changed.clear()
            try:
                if self.replan_calibrated:
                    self.replan_calibrated = False
                    await self.replan(calibrated=True)
                else:
                    await self.replan()
            except (HmpError, ValueError) as exc:
                self.log.error("placement_failed", error=str(exc))
                self.core.fail(f"placement: {exc}")
                return
            await self.changed.wait()
            await asyncio.sleep(0.2)  # several changes at once (a worker left, another joined): one re-plan

    async def wait_for_workers(self) -> None:
        workers = [w.id for w in self.cfg.workers]
        while True:
            missing = [w for w in workers if self.core.membership[w].state in NOT_JOINED]
            if not missing:
                return
            if self.first_join is not None and time.monotonic() - self.first_join > self.pcfg.join_wait_s:
                self.log.info("planning_without", missing=missing)
                return
            await asyncio.sleep(0.05)

    def live_workers(self) -> dict[str, list[str]]:
        live: dict[str, list[str]] = {}
        for w in self.cfg.workers:
            if self.core.membership[w.id].state in UP:
                live.setdefault(self.resource_of(w.id), []).append(w.id)
        return live

    def counts(self, live: dict[str, list[str]]) -> dict[str, int]:
        return {r["name"]: len(live.get(r["name"], [])) for r in self.pcfg.resources}

    async def replan(self, calibrated: bool = False) -> None:
        """Plan for the live workers and tell them. ``calibrated``: a calibration changed the
        problem's figures (membership did not change): keep the running stages, untouched, unless the
        new plan differs."""
        live = self.live_workers()
        if not live:
            self.log.info("no_live_workers")
            return
        assert self.problem is not None
        counts = self.counts(live)
        if calibrated and self.costs is not None:
            self.problem = calibration.calibrated_problem(self.problem, self.costs, self.profiled_problem)
        if self.plan is None:
            plan = await asyncio.to_thread(make_planner(self.pcfg.planner).plan, self.problem.with_counts(counts))
        else:
            current = self.plan.assignment if self.plan is not None else None
            plan = await asyncio.to_thread(replan, self.problem, counts, self.pcfg.planner, current, self.pcfg.min_gain)
        problem = self.problem.with_counts(counts)
        plan = runnable(plan, problem, live)
        previous = {w: (s.start, s.stop) for s in self.stages for w in s.workers}
        stages = assign_workers(plan, problem, live, micro_batches=self.pcfg.micro_batches,
                                use_spare=self.pcfg.use_spare_workers, previous=previous)
        if calibrated and [(s.start, s.stop, s.resource, s.workers) for s in stages] == \
                [(s.start, s.stop, s.resource, s.workers) for s in self.stages]:
            self.log.info("calibrated_plan_kept", plan=self.plan_id)
            return
        if self.history:
            self.history[-1]["measured"] = self.measured()
            self.history[-1]["ended_s"] = round(self.elapsed(), 3)
        self.plan, self.stages, self.plan_id = plan, stages, self.plan_id + 1
        start_step = self.max_step
        self.history.append(self.describe(problem, plan, stages, start_step, counts))
        self.log.info("plan", plan=self.plan_id, planner=plan.planner, start_step=start_step,
                      stages=[f"{s.start}-{s.stop - 1}@{s.resource}x{len(s.workers)}" for s in stages],
                      predicted=round(self.history[-1]["predicted_throughput"], 1), cost=plan.cost)
        await self.tell_workers(start_step)

    async def tell_workers(self, start_step: int) -> None:
        members, pcfg = self.core.membership, self.pcfg
        addresses = [tuple(members[w].address for w in s.workers) for s in self.stages]
        msgs: dict[str, StageAssign] = {}
        for k, s in enumerate(self.stages):
            for i, w in enumerate(s.workers):
                msgs[w] = StageAssign(plan=self.plan_id, stage=k, stages=len(self.stages), start=s.start, stop=s.stop,
                                      index=i, width=len(s.workers), prev=addresses[k - 1] if k else (),
                                      next=addresses[k + 1] if k + 1 < len(self.stages) else (),
                                      micro_batches=pcfg.micro_batches, batch_size=self.cfg.train.batch_size,
                                      start_step=start_step, steps=self.steps)
        for ws in self.live_workers().values():
            for w in ws:
                msgs.setdefault(w, StageAssign(plan=self.plan_id, stage=-1, stages=len(self.stages),
                                               start_step=start_step, steps=self.steps))
        results = await asyncio.gather(*(self.send(w, m) for w, m in msgs.items()), return_exceptions=True)
        for w, r in zip(msgs, results):
            if isinstance(r, Exception):
                self.log.warning("stage_assign_failed", worker=w, error=str(r))  # it left: the next re-plan sees it

    # ---------------------------------------------------------------- report
    def status(self) -> dict[str, Any]:
        """The running plan, for the scheduler's status (what `hmp-launch` and tests poll)."""
        return {"plan": self.plan_id, "replans": max(0, len(self.history) - 1), "max_step": self.max_step,
                "stages": [{"layers": [s.start, s.stop - 1], "resource": s.resource, "workers": list(s.workers)}
                           for s in self.stages]}

    def stage_loads(self, stages: list[StageWorkers]) -> list[StageLoad]:
        """The runtime model's view of staffed stages: compute per micro-batch (the micro-batch
        profile, uncalibrated), workers and parameter bytes."""
        problem = self.profiled_problem
        assert problem is not None and self.micro_times
        return [StageLoad(s.resource, sum(self.micro_times[i][s.resource] for i in range(s.start, s.stop)), len(s.workers),
                          float(sum(problem.layers[i].param_bytes for i in range(s.start, s.stop)))) for s in stages]

    def predict(self, stages: list[StageWorkers]) -> calibration.Prediction:
        assert self.costs is not None
        return calibration.predict(self.stage_loads(stages), self.pcfg.micro_batches, self.cfg.train.batch_size, self.costs)

    def describe(self, problem: PlacementProblem, plan: Plan, stages: list[StageWorkers], start_step: int,
                 counts: dict[str, int]) -> dict[str, Any]:
        pred = self.predict(stages)
        return {"plan": self.plan_id, "planner": plan.planner or self.pcfg.planner, "started_s": round(self.elapsed(), 3),
                "start_step": start_step, "workers_available": counts,
                "layers": {lay.name: problem.resources[r].name for lay, r in zip(problem.layers, plan.assignment)},
                "cost": plan.cost if plan.feasible else None, "feasible": plan.feasible, "reason": plan.reason,
                # the runtime model's samples/s for the stages as staffed (calibrated costs once a plan
                # has run; replaced by the calibrated figure when this plan is calibrated)
                "predicted_throughput": pred.samples_per_s, "predicted_samples_per_s": pred.samples_per_s,
                "runtime_model": {**pred.as_dict(), "costs": self.costs.as_dict() if self.costs else None},
                # the planner's cost model: with the planner's worker counts, and with the stages as staffed
                "planned_throughput": plan.throughput, "cost_model_throughput": predicted_throughput(stages),
                "stages": [{"layers": [s.start, s.stop - 1], "resource": s.resource, "workers": list(s.workers),
                            "planned_workers": p.workers,
                            "provenance": problem.resources[p.resource].provenance,
                            # every stage moves a batch per step: its predicted rate is the pipeline's
                            "predicted_samples_per_s": pred.samples_per_s,
                            "predicted_worker_ms": pred.worker_s[k] * 1e3,
                            "cost_model_samples_per_s": s.predicted_throughput,
                            # per batch, the cost model's: compute with the stage's workers, and the
                            # boundary term (bytes at the bandwidth + per-message overhead)
                            "predicted_compute_ms": s.compute_s / len(s.workers) * 1e3,
                            "predicted_transfer_ms": s.transfer_s * 1e3}
                           for k, (s, p) in enumerate(zip(stages, plan.stages))]}

    def try_calibrate(self) -> None:
        """Calibrate the runtime model on the running plan once every worker of its stages has
        reported enough steps (``calibration.MIN_CALIBRATION_STEPS``) over enough time
        (``MIN_CALIBRATION_S``) since its first report under the plan; record it in the plan's entry."""
        if self.costs is None or not self.stages or not self.history or self.history[-1]["plan"] != self.plan_id:
            return
        m, batch = self.pcfg.micro_batches, self.cfg.train.batch_size
        measured = []
        for s in self.stages:
            reports = [self.latest.get(w, {}) for w in s.workers]
            if any(r.get("plan") != self.plan_id for r in reports):
                return
            per_step = [len(micro_batches_of(i, len(s.workers), m)) * batch / m for i in range(len(s.workers))]
            # from each worker's first report under the plan: its start (pulls, warm-up) left out
            since = [self.first_reports.get((self.plan_id, w)) for w in s.workers]
            sm = StageMeasurement.from_reports(reports, per_step, since, min_seconds=calibration.MIN_CALIBRATION_S)
            if sm is None:
                return
            measured.append(sm)
        try:
            cal = calibration.calibrate(self.stage_loads(self.stages), measured, m, batch, self.costs)
        except ValueError as exc:  # a figure out of range (a worker's clock): keep the costs we have
            self.log.warning("calibration_failed", plan=self.plan_id, error=str(exc))
            self.calibrated_plan = self.plan_id
            return
        self.calibrated_plan = self.plan_id
        self.record_calibration(self.history[-1], cal)
        self.costs = cal.costs
        self.log.info("calibrated", plan=self.plan_id, predicted=round(cal.predicted.samples_per_s, 1),
                      costs=cal.costs.as_dict())
        if self.calibrate == "replan":
            self.replan_calibrated = True
            self.changed.set()

    def record_calibration(self, entry: dict[str, Any], cal: Calibration) -> None:
        entry["predicted_before_calibration"] = entry["predicted_throughput"]
        entry["predicted_throughput"] = entry["predicted_samples_per_s"] = cal.predicted.samples_per_s
        entry["calibration"] = {**cal.as_dict(), "at_s": round(self.elapsed(), 3),
                                "measured": [{"busy_ms": x * 1e3, "other_ms": y * 1e3}
                                             for x, y in ((mm.busy_s, mm.other_s) for mm in cal.measured)]}
        for st, w in zip(entry["stages"], cal.predicted.worker_s):
            st["predicted_samples_per_s"] = cal.predicted.samples_per_s
            st["predicted_worker_ms"] = w * 1e3

    def measured(self) -> list[dict[str, float]]:
        """Per stage of the current plan: samples/s through the stage (its workers summed), what
        its compute alone sustained (samples per busy second, summed), and where its workers' wall
        time went (compute, awaiting the PS push, waiting for messages; the rest is the engine's
        own work: encode/decode, dispatch, sends)."""
        out = []
        for s in self.stages:
            reports = [self.latest.get(w, {}) for w in s.workers]
            reports = [r for r in reports if r.get("plan") == self.plan_id]
            n = max(1, len(reports))
            out.append({"samples_per_s": sum(r.get("stage_samples_per_s", 0.0) for r in reports),
                        "compute_samples_per_s": sum(r.get("stage_capacity", 0.0) for r in reports),
                        # the stage's workers' average share of wall time in compute / push / waiting
                        **{f"{k}_fraction": sum(r.get(f"stage_{k}_fraction", 0.0) for r in reports) / n
                           for k in ("busy", "push", "idle")},
                        "reports": len(reports)})
        return out

    def report(self) -> dict[str, Any]:
        if self.history and "measured" not in self.history[-1]:
            self.history[-1]["measured"] = self.measured()
            self.history[-1]["ended_s"] = round(self.elapsed(), 3)
        problem = self.profiled_problem
        ref = reference_type(problem) if problem else None
        return {"planner": self.pcfg.planner, "micro_batches": self.pcfg.micro_batches,
                "batch_size": self.cfg.train.batch_size, "steps": self.steps,
                "message_overhead_s": problem.message_overhead_s if problem else None,
                "bandwidth_bytes_per_s": problem.bandwidth_bytes_per_s if problem else None,
                "profile": [{"layer": lay.name, "kind": lay.kind, "cpu_ms": lay.time_s[ref] * 1e3 if ref else None,
                             "ms": {r: t * 1e3 for r, t in lay.time_s.items()}, "out_bytes": lay.out_bytes,
                             "param_bytes": lay.param_bytes,
                             # one micro-batch's forward+backward per type: what the runtime model's c_k sums
                             "micro_batch_ms": {r: t * 1e3 for r, t in micro.items()}}
                            for lay, micro in zip(problem.layers if problem else (), self.micro_times)],
                # the runtime model's costs as the job ended (calibrated ones once a plan was calibrated)
                "runtime_costs": self.costs.as_dict() if self.costs else None, "calibrate": self.calibrate,
                "resources": [{"name": r.name, "price_per_hour": r.price_per_hour, "provenance": r.provenance}
                              for r in (problem.resources if problem else ())],
                "plans": self.history, "replans": max(0, len(self.history) - 1)}
