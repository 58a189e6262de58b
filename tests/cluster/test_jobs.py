"""The job manager (hmp.manager): its sans-IO core on scripted events, job files, and real ring jobs placed
by a scheduler onto emulated hosts' slots (docs/jobs.md)."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hmp.emulate import EmulatedHosts, EmulationUnavailable, HostSpec, load_hosts
from hmp.errors import ConfigError, RemoteError
from hmp.gadget.interface import ClusterSpec, PendingJob
from hmp.gadget.interface import HostSpec as SlotHost
from hmp.gadget.jobs import LinearDecay
from hmp.gadget.model import ModelType, NetworkConstants, RingCostModel
from hmp.gadget.schedulers import make_scheduler
from hmp.manager.core import ManagerCore
from hmp.manager.service import DONE, FAILED, JobManager
from hmp.manager.spec import load_job, loads_job, topology
from hmp.messages import Submit
from hmp.transport.endpoint import Client

# one worker runs the module: its emulated hosts (one subnet) are shared
pytestmark = pytest.mark.xdist_group("emulated-jobs")

BIN = Path(sys.executable).parent


# ----------------------------------------------------------------------------- the core, scripted
class Scripted:
    """A scheduler that answers each call with the next scripted decision (and records what it saw)."""

    name = "scripted"

    def __init__(self, *answers: dict) -> None:
        self.answers = list(answers)
        self.views = []

    def schedule(self, view):
        self.views.append(view)
        return self.answers.pop(0) if self.answers else {}


def _cluster(slots=(2, 2), link_bytes_s=25e6) -> ClusterSpec:
    return ClusterSpec(tuple(SlotHost(f"h{i}", s, link_bytes_s) for i, s in enumerate(slots)))


def _cost(cluster: ClusterSpec) -> RingCostModel:
    return RingCostModel(cluster, [ModelType("m", grad_bytes=4e6, compute_s=0.01, local_bsz=32)],
                         NetworkConstants(intra_host_bytes_s=1e9, hop_latency_s=0.0, link_efficiency=1.0))


def _job(jid: str, lo: int = 1, hi: int = 4, want: int = 2, t: float = 0.0) -> PendingJob:
    return PendingJob(job_id=jid, submit_s=t, model="m", min_workers=lo, max_workers=hi, requested_workers=want,
                      samples=6400.0, utility=LinearDecay(1.0, 600.0))


def test_core_starts_what_the_scheduler_places_and_frees_slots_when_a_job_ends():
    """Arrivals and completions each call the scheduler; its placements start, take slots, and give them back."""
    cluster = _cluster()
    sched = Scripted({"a": (2, 0)}, {}, {"b": (1, 1)})
    core = ManagerCore(cluster, sched, _cost(cluster))
    starts = core.submit(_job("a"), 0.0)
    assert [(s.job_id, s.placement) for s in starts] == [("a", (2, 0))] and core.free == [0, 2]
    assert core.submit(_job("b", lo=2), 1.0) == [] and [p.job_id for p in core.pending] == ["b"]
    assert sched.views[-1].free == (0, 2) and set(sched.views[-1].running) == {"a"}
    starts = core.finish("a", 5.0)
    assert [(s.job_id, s.placement) for s in starts] == [("b", (1, 1))] and core.free == [1, 1]
    assert sched.views[-1].pending[0].job_id == "b" and not sched.views[-1].running
    core.finish("b", 9.0)
    assert core.free == [2, 2] and not core.running and not core.pending and not core.refused


def test_core_refuses_placements_that_do_not_fit_or_break_a_jobs_bounds():
    """A placement over the free slots (counting the same answer's others), outside [min, max] workers, or
    for a job that is not pending is refused and not run; the job stays queued."""
    cluster = _cluster()
    sched = Scripted({"a": (2, 2), "b": (1, 0), "c": (2, 0), "zzz": (1, 0)})
    core = ManagerCore(cluster, sched, _cost(cluster))
    core.pending = [_job("a", hi=3), _job("b", lo=1), _job("c", lo=1)]
    starts = core._schedule(0.0)
    reasons = {r.job_id: r.reason for r in core.refused}
    assert set(reasons) == {"a", "c", "zzz"}
    assert "outside [1, 3]" in reasons["a"] and "free slots" in reasons["c"] and "not a pending job" in reasons["zzz"]
    assert [s.job_id for s in starts] == ["b"] and core.free == [1, 2]
    assert [p.job_id for p in core.pending] == ["a", "c"]


def test_core_refuses_a_job_larger_than_the_cluster_and_a_duplicate_id():
    cluster = _cluster()
    core = ManagerCore(cluster, Scripted(), _cost(cluster))
    with pytest.raises(ValueError, match="more than the cluster's 4"):
        core.submit(_job("a", lo=5, hi=5, want=5), 0.0)
    core.submit(_job("a"), 0.0)
    with pytest.raises(ValueError, match="already in use"):
        core.submit(_job("a"), 0.0)


def test_core_averages_the_predicted_iteration_time_over_the_run():
    """Two rings cross h0's link from t=0 to t=10 (each gets half of it), then one runs alone until t=20: the
    average prediction weighs each period by its length (hand arithmetic on the cost model)."""
    cluster = _cluster(slots=(2, 2, 2))
    cost = _cost(cluster)
    core = ManagerCore(cluster, Scripted({"a": (1, 1, 0), "b": (1, 0, 1)}), cost)
    core.pending = [_job("a"), _job("b")]
    starts = core._schedule(0.0)
    shared = 0.01 + 1.0 * 4e6 / (25e6 / 2)   # ring factor 2(w-1)/w = 1 for two workers; half of h0's link
    alone = 0.01 + 1.0 * 4e6 / 25e6
    assert [s.predicted_iteration_s for s in starts] == pytest.approx([shared, shared])
    core.finish("b", 10.0)
    assert core.predicted_iteration_s("a", 20.0) == pytest.approx((shared * 10 + alone * 10) / 20)


# ----------------------------------------------------------------------------- job files
JOB = """
[job]
name = "tiny"
heartbeat_interval_s = 0.5
plot = false  # the tests read report.json; drawing loss.png is the slow part of a short job's end

[model]
name = "digits_mlp"
args = {{ hidden = [32] }}

[data]
kind = "digits"

[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9

[train]
batch_size = 32
epochs = {epochs}
max_seconds = {max_seconds}
eval_every_s = 1.0

[submit]
min_workers = {lo}
max_workers = {hi}
workers = {want}
utility = {{ kind = "linear", value = 1.0, zero_at_s = 600 }}
"""


def _job_text(lo=2, hi=2, want=2, epochs=2, max_seconds=60) -> str:
    return JOB.format(lo=lo, hi=hi, want=want, epochs=epochs, max_seconds=max_seconds)


@pytest.mark.parametrize("change, key", [
    (lambda t: t + "\n[other]\nx = 1\n", "other"),
    (lambda t: t.split("[submit]")[0], "submit"),
    (lambda t: t + "\n[[nodes]]\nid = 's'\nrole = 'scheduler'\n", "nodes"),
    (lambda t: t + "\n[cluster]\ncpu_workers = 2\n", "cluster"),
    (lambda t: t.replace("min_workers = 2", "min_workers = 3"), "submit.max_workers"),
    (lambda t: t.replace("workers = 2\nutility", "workers = 0\nutility"), "submit.workers"),
    (lambda t: t.replace('kind = "linear"', 'kind = "soon"'), "submit.utility.kind"),
    (lambda t: t.replace("zero_at_s = 600", "zero_at_s = -1"), "submit.utility.zero_at_s"),
    (lambda t: t.replace("[submit]", "[submit]\ngpus = 2"), "submit.gpus"),
    (lambda t: t.replace("batch_size = 32", 'batch_size = 32\nconsistency = "async"'), "train.consistency"),
    (lambda t: t.replace('name = "digits_mlp"', 'name = "resnet"'), "model.name"),
    (lambda t: t.replace("max_workers = 2", "max_workers = 60"), "submit.max_workers"),
])
def test_bad_job_files_name_the_file_and_key(change, key):
    """A job file the manager cannot run is a ConfigError naming the file and the key."""
    with pytest.raises(ConfigError) as info:
        loads_job(change(_job_text()), "jobs/bad.toml")
    assert info.value.key == key and "jobs/bad.toml" in str(info.value)


def test_a_placed_job_becomes_a_topology_with_one_worker_per_slot():
    """The topology: the scheduler on the host with most workers at the given port, workers on their hosts."""
    spec = loads_job(_job_text(lo=1, hi=4, want=3), "j.toml")
    assert spec.samples == spec.epochs * spec.train_examples and spec.grad_bytes == (64 * 32 + 32 + 32 * 10 + 10) * 4
    import tomllib
    raw = tomllib.loads(topology(spec, job_name="tiny-j1", placement={"b": 2, "c": 1}, port=47555, report_dir="/tmp/r"))
    assert raw["job"]["name"] == "tiny-j1" and raw["train"]["consistency"] == "allreduce"
    assert [(n["id"], n["role"], n["host"]) for n in raw["nodes"]] == [
        ("scheduler", "scheduler", "b"), ("w0", "cpu_worker", "b"), ("w1", "cpu_worker", "b"), ("w2", "cpu_worker", "c")]
    assert raw["nodes"][0]["bind"] == "tcp://127.0.0.1:47555"


def test_shipped_job_files_and_hosts_file_load():
    for f in ("conf/jobs/digits_small.toml", "conf/jobs/mlp_wide.toml"):
        load_job(Path(__file__).parents[2] / f)
    specs, _ = load_hosts(Path(__file__).parents[2] / "conf/hosts4x2.toml")
    assert [s.slots for s in specs] == [2, 2, 2, 2]


@pytest.mark.parametrize("text, slots", [("", 1), ("slots = 3\n", 3)])
def test_hosts_file_slots_default_to_one(tmp_path, text, slots):
    p = tmp_path / "hosts.toml"
    p.write_text("[[hosts]]\nname = 'h0'\n" + text)
    assert load_hosts(p)[0][0].slots == slots


@pytest.mark.parametrize("value", ["0", "1.5", "true"])
def test_bad_slots_name_the_key(tmp_path, value):
    p = tmp_path / "hosts.toml"
    p.write_text(f"[[hosts]]\nname = 'h0'\nslots = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_hosts(p)
    assert info.value.key == "hosts[0].slots" and str(p) in str(info.value)


# ----------------------------------------------------------------------------- real jobs on emulated hosts
@pytest.fixture(scope="module")
def hosts():
    """Four emulated hosts of one slot each on 400 Mbit/s links, shared by this module's managers."""
    try:
        h = EmulatedHosts([HostSpec(f"h{i}", bandwidth_mbit=400, slots=1) for i in range(4)], "10.231.21.0/24")
        h.start()
    except EmulationUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    try:
        yield h
    finally:
        h.close()
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert h.tag not in out


class Recording:
    """Wraps a scheduler and records every placement it chose."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.chosen = inner, inner.name, {}

    def schedule(self, view):
        out = self.inner.schedule(view)
        self.chosen.update(out)
        return out


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.timeout(120)
async def test_two_jobs_submitted_together_both_finish_where_the_scheduler_placed_them(tmp_path, hosts):
    """Two 2-worker jobs on four 1-slot hosts: each ring spans two hosts; both finish, each on the placement
    the scheduler chose, and every daemon's process really ran inside its host's network namespace."""
    sched = Recording(make_scheduler("gadget"))
    job = _write(tmp_path, "job.toml", _job_text())
    async with JobManager(hosts, sched, run_dir=tmp_path / "runs", grace_s=3) as m:
        a, b = await m.submit(job), await m.submit(job)
        ra, rb = await asyncio.wait_for(asyncio.gather(a.wait(), b.wait()), 90)
    for r in (ra, rb):
        assert r.status == DONE, r.error
        chosen = sched.chosen[r.job_id]
        assert r.placement == {h: n for h, n in zip(m.host_names, chosen) if n} and r.workers == 2
        assert len(r.placement) == 2  # one slot per host: the ring crosses the bridge
        for nid, node in r.nodes.items():
            assert node["ran_in"] == node["host"], (nid, node)
        assert sorted(n["host"] for nid, n in r.nodes.items() if nid != "scheduler") == sorted(r.placement)
        assert r.updates > 0 and r.iteration_s > 0 and r.queue_s >= 0 and r.jct_s > r.queue_s
        assert 0 < r.utility <= 1 and not math.isnan(r.final_accuracy)
        assert r.predicted_iteration_s > 0
    assert set(ra.placement).isdisjoint(rb.placement)  # no slot used twice
    assert m.core.free == [1, 1, 1, 1]


@pytest.mark.timeout(120)
async def test_a_bad_submission_is_refused_while_a_running_job_continues(tmp_path, hosts):
    """A bad job file, through the API and through hmp's transport (``submit``), is refused with an error
    naming the file and key; the job already running goes on and finishes."""
    good = _write(tmp_path, "good.toml", _job_text(epochs=3))
    bad_text = _job_text().replace('kind = "linear"', 'kind = "soon"')
    bad = _write(tmp_path, "bad.toml", bad_text)
    async with JobManager(hosts, "gadget", run_dir=tmp_path / "runs", bind="tcp://127.0.0.1:0", grace_s=3) as m:
        running = await m.submit(good)
        with pytest.raises(ConfigError) as info:
            await m.submit(bad)
        assert info.value.key == "submit.utility.kind" and str(bad) in str(info.value)
        client = Client(m.address, name="test-submit", timeout_s=30)
        await client.connect()
        try:
            with pytest.raises(RemoteError) as remote:
                await client.request(Submit(job=bad_text, path=str(bad)))
        finally:
            await client.close()
        assert remote.value.code == "bad_config" and "submit.utility.kind" in remote.value.remote_message
        assert str(bad) in remote.value.remote_message
        result = await running.wait(90)
    assert result.status == DONE, result.error
    assert list(m.results) == [running.job_id]  # the refused files never became jobs


@pytest.mark.timeout(120)
async def test_a_job_whose_worker_is_killed_fails_alone(tmp_path, hosts):
    """Killing one worker of a running job that needs both (min_workers = 2) fails that job (its other
    daemons stopped, its slots freed); the other job finishes."""
    long = _write(tmp_path, "long.toml", _job_text(epochs=200, max_seconds=80))
    short = _write(tmp_path, "short.toml", _job_text(epochs=3))
    async with JobManager(hosts, "gadget", run_dir=tmp_path / "runs", grace_s=3) as m:
        victim, other = await m.submit(long), await m.submit(short)
        # Wait until the victim's ring trains (its workers have reported steps), then kill one worker.
        for _ in range(300):
            st = await m.clusters[victim.job_id].status(timeout_s=1.0) if victim.job_id in m.clusters else None
            if st and any(w.get("updates", 0) > 0 for w in st.get("workers", {}).values()):
                break
            await asyncio.sleep(0.2)
        else:
            pytest.fail("the long job never started training")
        pids = {nid: p.pid for nid, p in m.clusters[victim.job_id].procs.items()}
        m.clusters[victim.job_id].kill("w1", signal.SIGKILL)
        rv, ro = await asyncio.wait_for(asyncio.gather(victim.wait(), other.wait()), 90)
    assert rv.status == FAILED and "w1" in rv.error and rv.utility == 0
    assert ro.status == DONE, ro.error
    for pid in pids.values():  # every daemon of the failed job is gone
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert m.core.free == [1, 1, 1, 1] and not m.core.running


@pytest.mark.timeout(120)
def test_cli_submit_and_stop(tmp_path):
    """hmp-manager on this machine's loopback (--no-emulate) takes hmp-submit's jobs: a bad file exits 2 with the
    key, a good one with --wait exits 0 once done; SIGTERM stops the manager (exit 0)."""
    hosts_file = _write(tmp_path, "hosts.toml", "[[hosts]]\nname = 'a'\nslots = 2\n")
    good = _write(tmp_path, "good.toml", _job_text(epochs=1))
    bad = _write(tmp_path, "bad.toml", _job_text().replace("min_workers = 2", "min_workers = 3"))
    address = "tcp://127.0.0.1:47391"
    mgr = subprocess.Popen([BIN / "hmp-manager", "--hosts", hosts_file, "--no-emulate", "--scheduler", "first_fit",
                            "--bind", address, "--run-dir", tmp_path / "runs"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    refused = None
    try:
        assert "listening on" in mgr.stdout.readline()
        # hmp-submit first checks that something listens (no manager: one line at once), then sends: the manager
        # refuses a bad file with the file and key.
        refused = subprocess.Popen([BIN / "hmp-submit", bad, "--manager", address], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        r = subprocess.run([BIN / "hmp-submit", good, "--manager", address, "--wait"], capture_output=True, text=True,
                           timeout=90)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[0] == "j1" and '"status": "done"' in r.stdout
        _, err = refused.communicate(timeout=60)
        assert refused.returncode == 2 and "submit.max_workers" in err and str(bad) in err
    finally:
        if refused is not None:
            if refused.poll() is None:
                refused.kill()
            refused.communicate()
        mgr.send_signal(signal.SIGTERM)
        try:
            assert mgr.wait(timeout=30) == 0
        finally:
            if mgr.poll() is None:
                mgr.kill()
                mgr.wait()
            mgr.stdout.close()


# ----------------------------------------------------------------------------- slots from Ray (jobs: tests/test_ray.py)
def test_a_ray_nodes_host_name_slots_and_link_follow_the_documented_rule():
    """A Ray node (an entry of ray.nodes()) as a host: named by its hmp_host:<name> resource, else its IP; slots
    from hmp_slots, else its whole CPUs (GPUs add none); link from hmp_link_mbit, else the default."""
    from hmp.manager.ray_inventory import DEFAULT_LINK_MBIT, host_of_node

    plain = host_of_node({"NodeID": "n1", "NodeManagerAddress": "10.0.0.5",
                          "Resources": {"CPU": 7.5, "GPU": 2.0, "memory": 1e9, "node:10.0.0.5": 1.0}})
    assert (plain.name, plain.ip, plain.slots, plain.gpus, plain.bandwidth_mbit) == (
        "10.0.0.5", "10.0.0.5", 7, 2.0, DEFAULT_LINK_MBIT)
    named = host_of_node({"NodeID": "n2", "NodeManagerAddress": "10.0.0.6",
                          "Resources": {"CPU": 16.0, "hmp_host:gpubox": 100.0, "hmp_slots": 3.0,
                                        "hmp_link_mbit": 200.0}})
    assert (named.name, named.slots, named.bandwidth_mbit, named.ray_node) == ("gpubox", 3, 200.0, "n2")


@pytest.mark.parametrize("args, message", [
    (["--engine", "ray", "--hosts", "h.toml"], "--hosts and --no-emulate are for the local engine"),
    (["--address", "auto"], "--address needs --engine ray"),
])
def test_manager_engine_flags_are_checked(args, message):
    r = subprocess.run([BIN / "hmp-manager", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
