"""Parameter-server benchmark: hmp's PS against torch.distributed (gloo), all in one run.

(a) Push rounds. Two worker processes each push 16 MiB of float32 gradients through two real PS
    shard daemons (``python -m hmp.nodes.main ps``; 1 MiB chunks, 8 per shard) and get the new
    values back (``PSClient.push``), ``sync`` and ``async``; against two processes doing gloo
    ``all_reduce`` of a 16 MiB float32 tensor. A round is one push (one all_reduce) by each of
    the two workers; rounds/s = rounds / the slower worker's time. Every peer's processes start
    once and are warmed up; then ``--blocks`` cycles of one short block per peer (``--warm``
    untimed + ``--rounds`` timed rounds) in the order gloo, sync, async, reversed every other
    cycle. Each cycle gives one ratio from two adjacent blocks; ``ratio_vs_gloo_allreduce`` is
    the median of those per-cycle ratios (``_spread``: min, quartiles, max).
(b) Time to 95% test accuracy on the digits MLP with two worker processes: hmp (``LocalCluster``:
    scheduler, 2 shards, 2 ``cpu_worker`` s, batch 32 each) in sync and async (and, with
    ``--modes``, ssp) mode, against torch DistributedDataParallel (gloo) on two processes with
    the same model, seed, data shards, optimizer, batch size and evaluation cadence. hmp's time is
    the scheduler's clock (started when the first worker joins) at the first report whose test
    accuracy reaches the target; DDP's is training time on rank 0 until an evaluation reaches it
    (evaluation time excluded). DDP's processes stay up; every hmp run (a fresh cluster, ~15 s
    with its start) sits between two blocks of ``--ddp-runs`` DDP runs, and its ratio is the
    median DDP time around it over its own time; ``ratio_{mode}_vs_ddp`` is the median over the
    mode's runs and ``ratio_vs_ddp`` that of the mode with the shortest median time. Time to a
    threshold of a noisy accuracy curve varies a lot from run to run (see ``*_spread``): raise
    ``--repeats`` for a tighter ratio_vs_ddp.

    python bench/ps.py [--json] [--quick] [--blocks N] [--rounds N] [--warm N] [--repeats N]
                       [--ddp-runs N] [--modes sync,async,ssp] [--eval-every S] [--skip push|digits]

With ``--json`` the last line is one JSON object with every figure: ``ratio_vs_gloo_allreduce``
(sync PS rounds/s / gloo rounds/s), ``ratio_vs_ddp`` (DDP time / hmp best-mode time), their
``*_spread`` objects, per-peer ``*_blocks`` summaries, and the machine's load during the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import (guard, CpuMeter, alternate, cpu_line, fmt_spread, is_quiet, load_average, quantile,  # noqa: E402
                    ratios, spread, summary)

MiB = 1 << 20
# deep_mlp with depth 0 is one Linear(4095, 1024): 4095 * 1024 weights + 1024 biases = 4 Mi float32,
# exactly 16 MiB of parameters, cut into 16 chunks of 1 MiB.
PUSH_MODEL = {"in_features": 4095, "width": 1, "depth": 0, "classes": 1024}
PUSH_NUMEL = 4095 * 1024 + 1024
WORKERS = ("w0", "w1")
REPLY_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(folder: Path, *, consistency: str, model: str, model_args: dict[str, Any], chunk_bytes: int,
                 workers: list[tuple[str, str]], target: float = 0.0, eval_every_s: float = 1.0,
                 epochs: int = 20, max_seconds: float = 600.0, join_timeout_s: float = 60.0,
                 optimizer: str = 'name = "sgd"\nlr = 0.05\nmomentum = 0.9') -> Path:
    """A one-machine job on fixed loopback ports: scheduler, ps0, ps1 and the given workers.

    ``workers`` is ``[(id, extra TOML lines), ...]`` (all ``cpu_worker``).
    """
    args = ", ".join(f"{k} = {json.dumps(v)}" for k, v in model_args.items())
    text = f"""
[job]
name = "bench-{consistency}"
report_dir = "{folder / 'run'}"
heartbeat_interval_s = 0.5
join_timeout_s = {join_timeout_s}
log_format = "json"

[model]
name = "{model}"
args = {{ {args} }}
seed = 0

[data]
kind = "digits"

[optimizer]
{optimizer}

[train]
consistency = "{consistency}"
batch_size = 32
epochs = {epochs}
target_accuracy = {target}
max_seconds = {max_seconds}
eval_every_s = {eval_every_s}
report_interval_s = {eval_every_s}

[ps]
chunk_bytes = {chunk_bytes}
checkpoint_dir = "{folder / 'ckpt'}"
"""
    nodes = [("scheduler", "scheduler", f'bind = "tcp://127.0.0.1:{free_port()}"'),
             ("ps0", "ps", f'bind = "tcp://127.0.0.1:{free_port()}"'),
             ("ps1", "ps", f'bind = "tcp://127.0.0.1:{free_port()}"'),
             *[(wid, "cpu_worker", extra) for wid, extra in workers]]
    for nid, role, extra in nodes:
        text += f'\n[[nodes]]\nid = "{nid}"\nrole = "{role}"\n{extra}\n'
    path = folder / "job.toml"
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- process plumbing

def cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU seconds used so far by every thread of ``pids`` (Linux /proc; None elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    try:
        for pid in pids:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    total += int(fields[11]) + int(fields[12])  # utime, stime
    except OSError:
        return None
    return total / tick


class Peer:
    """A pair of worker processes driven block by block over pipes, all started at once."""

    def __init__(self, name: str, target: Any, args_of: Any) -> None:
        self.name = name
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(2)
        self.conns, self.procs = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(*args_of(rank), child, self.barrier), daemon=True,
                            name=f"{name}-{rank}")
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def _recv(self, conn: Any, timeout_s: float = REPLY_TIMEOUT_S) -> Any:
        if not conn.poll(timeout_s):
            raise TimeoutError(f"{self.name}: no answer from a worker process in {timeout_s} s")
        reply = conn.recv()
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise RuntimeError(f"{self.name} worker failed:\n{reply[1]}")
        return reply

    def ready(self) -> None:
        for c in self.conns:
            self._recv(c)

    def ask(self, *cmd: Any) -> list[Any]:
        for c in self.conns:
            c.send(cmd)
        return [self._recv(c) for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send(("stop",))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


class Daemons:
    """Real hmp daemons (``python -m hmp.nodes.main ROLE``) for one config; stopped on close."""

    def __init__(self, cfg_path: Path, ids: list[tuple[str, str]], log_dir: Path) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list[Any] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        try:
            for role, nid in ids:
                logf = open(log_dir / f"{nid}.log", "wb")  # noqa: SIM115 - closed in close()
                self.logs.append(logf)
                self.procs[nid] = subprocess.Popen(
                    [sys.executable, "-m", "hmp.nodes.main", role, "--config", str(cfg_path), "--id", nid],
                    stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def check(self) -> None:
        for nid, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"daemon {nid} exited with code {p.returncode}")

    def close(self, grace_s: float = 10.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self.logs:
            f.close()
        self.logs.clear()


# ----------------------------------------------------------------------------- (a) push rounds

def _ps_worker(cfg_path: str, name: str, shards: list[tuple[str, str]], conn: Any, barrier: Any) -> None:
    torch.set_num_threads(1)

    def body() -> None:
        import uvloop

        from hmp.client import PSClient
        from hmp.config import load

        async def main() -> None:
            cfg = load(cfg_path)
            async with PSClient.from_config(cfg, shards, name=name) as ps:
                for g in ps.sharded.flat.grads.values():
                    g.fill_(1e-4)  # a plausible gradient; SGD keeps the values finite and normal
                await ps.pull()  # waits until both shards serve (zmq queues until they bind)
                conn.send("ready")
                while True:
                    cmd = conn.recv()  # blocking: nothing else runs in this process meanwhile
                    if cmd[0] == "stop":
                        break
                    _, warm, rounds = cmd
                    for _ in range(warm):
                        await ps.push(samples=1)
                    barrier.wait()
                    t0 = time.perf_counter()
                    for _ in range(rounds):
                        await ps.push(samples=1)
                    conn.send(time.perf_counter() - t0)
                await ps.leave("bench done")

        uvloop.run(main())

    guard(conn, body)


def _gloo_worker(rank: int, port: int, numel: int, conn: Any, barrier: Any) -> None:
    torch.set_num_threads(1)

    def body() -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=REPLY_TIMEOUT_S))
        t = torch.empty(numel)
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            _, warm, rounds = cmd
            # Summing doubles the values each round: start small so they stay finite and normal.
            t.fill_(1e-20)
            for _ in range(warm):
                dist.all_reduce(t)
            barrier.wait()
            t0 = time.perf_counter()
            for _ in range(rounds):
                dist.all_reduce(t)
            conn.send(time.perf_counter() - t0)
        dist.destroy_process_group()

    guard(conn, body)


def bench_push(blocks: int, rounds: int, warm: int, modes: list[str], tmp: Path) -> dict[str, Any]:
    """Rounds/s of each peer: ``blocks`` cycles of one short block (``rounds`` timed rounds after
    ``warm`` untimed ones) per peer, in the order gloo, ps_sync, ps_async reversed every other
    cycle, so that gloo and ps_sync are always adjacent; per-cycle ratios and their spread."""
    if warm + rounds > 60:
        raise ValueError("at most 60 rounds per block, warm-up included (gloo's summed values must stay finite)")
    daemons: list[Daemons] = []
    peers: dict[str, Peer] = {}
    t0 = time.perf_counter()
    try:
        port = free_port()
        peers["gloo"] = Peer("gloo", _gloo_worker, lambda r: (r, port, PUSH_NUMEL))
        for mode in modes:
            folder = tmp / f"push-{mode}"
            folder.mkdir()
            cfg_path = write_config(folder, consistency=mode, model="deep_mlp", model_args=PUSH_MODEL,
                                    chunk_bytes=MiB, workers=[(w, "") for w in WORKERS], join_timeout_s=3600,
                                    optimizer='name = "sgd"\nlr = 0.01\nmomentum = 0.9')
            from hmp.config import load

            cfg = load(cfg_path)
            shards = [(s.id, s.bind) for s in cfg.shards]
            daemons.append(Daemons(cfg_path, [("scheduler", "scheduler"), ("ps", "ps0"), ("ps", "ps1")],
                                   folder / "logs"))
            peers[f"ps_{mode}"] = Peer(f"ps_{mode}", _ps_worker,
                                       lambda r, c=str(cfg_path), s=shards: (c, WORKERS[r], s))
        for p in peers.values():
            p.ready()
        for p in peers.values():  # warm-up of every peer before anything is timed
            p.ask("run", 0, max(5, rounds))
        times: dict[str, list[float]] = {name: [] for name in peers}
        cpu: dict[str, list[float]] = {name: [] for name in peers}
        pids = {name: [pr.pid for pr in p.procs] for name, p in peers.items()}
        for mode, d in zip(modes, daemons):
            pids[f"ps_{mode}"] += d.pids  # the shards' (and scheduler's) CPU counts too
        for b in range(blocks):
            for name in alternate(list(peers), b):  # gloo next to ps_sync, each first every other cycle
                for d in daemons:
                    d.check()
                c0 = cpu_seconds(pids[name])
                times[name].append(max(peers[name].ask("run", warm, rounds)))
                c1 = cpu_seconds(pids[name])
                if c0 is not None and c1 is not None:
                    cpu[name].append((c1 - c0) / (warm + rounds))
    finally:
        for p in peers.values():
            p.close()
        for d in daemons:
            d.close()
    res: dict[str, Any] = {"push_bytes": PUSH_NUMEL * 4, "rounds_per_block": rounds, "blocks": blocks,
                           "warm_rounds_per_block": warm, "wall_s": round(time.perf_counter() - t0, 1)}
    rps = {name: [rounds / t for t in ts] for name, ts in times.items()}
    for name, ts in times.items():
        res[f"{name}_rounds_per_s"] = round(quantile(rps[name], 0.5), 2)
        res[f"{name}_ms_per_round"] = round(1e3 * quantile(ts, 0.5) / rounds, 2)
        res[f"{name}_rounds_per_s_blocks"] = summary(rps[name], 2)
        if cpu[name]:
            res[f"{name}_cpu_ms_per_round"] = round(1e3 * quantile(cpu[name], 0.5), 2)
    for mode in modes:
        key = "ratio_vs_gloo_allreduce" if mode == "sync" else f"ratio_{mode}_vs_gloo_allreduce"
        rs = ratios(rps[f"ps_{mode}"], rps["gloo"])
        res[key] = round(quantile(rs, 0.5), 3)
        res[f"{key}_spread"] = spread(rs)
    return res


# ----------------------------------------------------------------------------- (b) digits, DDP

def _ddp_worker(rank: int, port: int, stop_at: Any, conn: Any, barrier: Any) -> None:
    torch.set_num_threads(1)

    def body() -> None:
        import torch.distributed as dist
        from torch.nn import functional as F
        from torch.nn.parallel import DistributedDataParallel as DDP

        from hmp.client import evaluate
        from hmp.data import load_digits_dataset, shard
        from hmp.models import digits_mlp

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=REPLY_TIMEOUT_S))
        data = load_digits_dataset()  # hmp's [data] kind = "digits" defaults: 20% test, seed 0
        x, y = shard(data.x_train, data.y_train, rank, 2)
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            _, target, eval_every_s, lr, momentum, batch, max_epochs = cmd
            torch.manual_seed(0)  # hmp's ShardedModel seeds with [model] seed = 0 before building
            model = DDP(digits_mlp())
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
            gen = torch.Generator().manual_seed(rank)  # hmp's worker: data.seed * 1000 + index
            with stop_at.get_lock():
                stop_at.value = -1
            barrier.wait()
            dist.barrier()
            eval_s, reached = 0.0, None
            t_start = time.perf_counter()
            next_eval = eval_every_s
            step, samples, acc = 0, 0, 0.0
            done = False
            for _epoch in range(max_epochs):
                order = torch.randperm(len(y), generator=gen)
                for pos in range(0, len(order), batch):
                    # Rank 0 names a step both ranks reach (rank 1 is at most one step ahead,
                    # the gradient all_reduce keeps them in step), so both stop after the same one.
                    if 0 <= stop_at.value <= step:
                        done = True
                        break
                    idx = order[pos:pos + batch]
                    opt.zero_grad(set_to_none=False)
                    loss = F.cross_entropy(model(x[idx]), y[idx])
                    loss.backward()
                    opt.step()
                    step += 1
                    samples += len(idx)
                    if rank == 0 and reached is None:
                        now = time.perf_counter() - t_start - eval_s
                        if now >= next_eval:
                            e0 = time.perf_counter()
                            acc = evaluate(model.module, data.x_test, data.y_test)["test_accuracy"]
                            eval_s += time.perf_counter() - e0
                            next_eval = now + eval_every_s
                            if acc >= target:
                                reached = now
                                stop_at.value = step + 1
                if done:
                    break
            wall = time.perf_counter() - t_start - eval_s
            if rank == 0 and reached is None:
                acc = evaluate(model.module, data.x_test, data.y_test)["test_accuracy"]
            conn.send({"time_to_target_s": reached, "train_s": wall, "samples": samples,
                       "samples_per_s": samples / wall, "steps": step, "test_accuracy": acc,
                       "eval_s": eval_s})
        dist.destroy_process_group()

    guard(conn, body)


class DDPPeer(Peer):
    def __init__(self) -> None:
        port = free_port()
        self.stop_at = mp.get_context("spawn").Value("l", -1)
        super().__init__("ddp", _ddp_worker, lambda r: (r, port, self.stop_at))

    def run(self, target: float, eval_every_s: float, lr: float, momentum: float, batch: int,
            max_epochs: int) -> dict[str, Any]:
        for c in self.conns:
            c.send(("run", target, eval_every_s, lr, momentum, batch, max_epochs))
        r0, r1 = [self._recv(c) for c in self.conns]
        return {"time_to_target_s": r0["time_to_target_s"], "test_accuracy": r0["test_accuracy"],
                "samples_per_s": r0["samples_per_s"] + r1["samples_per_s"], "steps": r0["steps"],
                "eval_s": r0["eval_s"]}


# ----------------------------------------------------------------------------- (b) digits, hmp

def hmp_digits(mode: str, folder: Path, target: float, eval_every_s: float, max_epochs: int,
               max_seconds: float, lr: float, momentum: float) -> dict[str, Any]:
    """One hmp job on LocalCluster; time to target from the scheduler's report series."""
    from hmp.cluster import LocalCluster

    folder.mkdir(parents=True)
    cfg_path = write_config(folder, consistency=mode, model="digits_mlp", model_args={}, chunk_bytes=16384,
                            workers=[("cpu0", "batch_size = 32"), ("cpu1", "batch_size = 32")], target=target,
                            eval_every_s=eval_every_s, epochs=max_epochs, max_seconds=max_seconds,
                            optimizer=f'name = "sgd"\nlr = {lr}\nmomentum = {momentum}')

    async def go() -> dict[str, Any]:
        async with LocalCluster(cfg_path, env={"PYTHONPATH": str(ROOT)}) as cluster:
            return await cluster.train(timeout_s=max_seconds + 120)

    report = asyncio.run(go())
    # Each worker's start of training on the scheduler's clock: its reports carry samples and
    # samples/s since its own start (hmp.nodes.worker.current_metrics), so start = t - samples / rate.
    starts = []
    for series in report["series"].values():
        for p in series:
            if p.get("samples", 0) > 0 and p.get("samples_per_s", 0) > 0:
                starts.append(p["t"] - p["samples"] / p["samples_per_s"])
                break
    reached = None
    for series in report["series"].values():
        for p in series:
            if p.get("test_accuracy", 0.0) >= target:
                reached = p["t"] if reached is None else min(reached, p["t"])
                break
    first, last = (min(starts), max(starts)) if starts else (0.0, 0.0)
    workers = report["workers"]
    return {"time_to_target_s": None if reached is None else reached - first,
            "time_to_target_both_s": None if reached is None else reached - last,
            "startup_skew_s": last - first, "final_elapsed_s": report["final"].get("elapsed_s"),
            "test_accuracy": report["final"].get("test_accuracy"),
            "samples_per_s": sum(w.get("samples_per_s", 0.0) for w in workers.values()),
            "updates": sum(w.get("updates", 0) for w in workers.values())}


def bench_digits(repeats: int, modes: list[str], tmp: Path, target: float, eval_every_s: float,
                 max_epochs: int, max_seconds: float, lr: float, momentum: float, ddp_runs: int) -> dict[str, Any]:
    """Each hmp run sits between two blocks of ``ddp_runs`` DDP runs (DDP's processes stay up); its
    ratio is the median DDP time of the blocks before and after it over its own time."""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in ["ddp", *modes]}
    per_run: dict[str, list[float]] = {m: [] for m in modes}  # DDP time around the run / the run's time
    inf = float("inf")
    ddp = DDPPeer()
    t0 = time.perf_counter()
    try:
        ddp.ready()
        ddp.run(target, eval_every_s, lr, momentum, 32, max_epochs)  # warm-up, not counted

        def ddp_block() -> list[float]:
            rs = [ddp.run(target, eval_every_s, lr, momentum, 32, max_epochs) for _ in range(ddp_runs)]
            runs["ddp"] += rs
            return [inf if x["time_to_target_s"] is None else x["time_to_target_s"] for x in rs]

        before = ddp_block()
        for r in range(repeats):
            for mode in alternate(modes, r):
                h = hmp_digits(mode, tmp / f"digits-{mode}-{r}", target, eval_every_s, max_epochs, max_seconds,
                               lr, momentum)
                runs[mode].append(h)
                after = ddp_block()
                d = quantile(before + after, 0.5)
                t = h["time_to_target_s"]
                per_run[mode].append(0.0 if t is None or d == inf else d / t)  # a miss counts as 0
                before = after
    finally:
        ddp.close()

    def med(xs: list[Any]) -> float | None:
        xs = [x for x in xs if x is not None]
        return round(quantile(xs, 0.5), 4) if xs else None

    res: dict[str, Any] = {"target_accuracy": target, "eval_every_s": eval_every_s, "repeats": repeats,
                           "ddp_runs_per_block": ddp_runs, "wall_s": round(time.perf_counter() - t0, 1)}
    for name, rs in runs.items():
        times = [x["time_to_target_s"] for x in rs]
        t_med = med([t if t is not None else inf for t in times])  # a miss counts as slowest
        res[name] = {"time_to_target_s": None if t_med == inf else t_med,
                     "reached": sum(t is not None for t in times), "runs": len(rs),
                     "time_to_target_s_runs": summary([t for t in times if t is not None]),
                     "samples_per_s": med([x["samples_per_s"] for x in rs]),
                     "test_accuracy": med([x["test_accuracy"] for x in rs]),
                     "all_times_s": [None if t is None else round(t, 3) for t in times]}
        if name != "ddp":
            for k in ("time_to_target_both_s", "startup_skew_s", "final_elapsed_s"):
                res[name][k] = med([x[k] for x in rs])
            res[f"ratio_{name}_vs_ddp"] = round(quantile(per_run[name], 0.5), 3)
            res[f"ratio_{name}_vs_ddp_spread"] = spread(per_run[name])
            res[f"ratio_{name}_vs_ddp_runs"] = [round(x, 3) for x in per_run[name]]
    return res


# ----------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    ap.add_argument("--blocks", type=int, default=30, help="(a) alternating cycles: one timed block per peer each")
    ap.add_argument("--rounds", type=int, default=4, help="(a) timed rounds per block (warm + rounds <= 60)")
    ap.add_argument("--warm", type=int, default=1, help="(a) untimed rounds before each block")
    ap.add_argument("--repeats", type=int, default=1,
                    help="(b) runs per hmp mode (median over them); each costs a cluster start (~15 s)")
    ap.add_argument("--ddp-runs", type=int, default=2, help="(b) DDP runs between two hmp runs")
    ap.add_argument("--modes", default="sync,async", help="(b) hmp consistency modes to run (sync,async,ssp)")
    ap.add_argument("--target", type=float, default=0.95, help="(b) test accuracy to reach")
    ap.add_argument("--eval-every", type=float, default=0.05,
                    help="(b) seconds of training between evaluations (both; the times' resolution)")
    ap.add_argument("--lr", type=float, default=0.05, help="(b) SGD learning rate (both)")
    ap.add_argument("--momentum", type=float, default=0.9, help="(b) SGD momentum (both)")
    ap.add_argument("--skip", choices=["push", "digits"], default=None, help="leave one part out")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.rounds, args.repeats, args.modes, args.ddp_runs = 3, 3, 1, "sync,async", 1
    modes = [m for m in args.modes.split(",") if m]
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    load_before = load_average()
    meter = CpuMeter()
    meter.start()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hmp-bench-ps-") as d:
        tmp = Path(d)
        if args.skip != "push":
            res["push"] = bench_push(args.blocks, args.rounds, args.warm, ["sync", "async"], tmp)
        if args.skip != "digits":
            dig = bench_digits(args.repeats, modes, tmp, args.target, args.eval_every, 60, 60.0, args.lr,
                               args.momentum, args.ddp_runs)
            dig["modes"] = modes
            best = min(modes, key=lambda m: dig[m]["time_to_target_s"] or float("inf"))
            dig["best_mode"] = best
            ddp_t, best_t = dig["ddp"]["time_to_target_s"], dig[best]["time_to_target_s"]
            # median of the best mode's per-run ratios (each against the DDP runs around it)
            dig["ratio_vs_ddp"] = dig[f"ratio_{best}_vs_ddp"] if ddp_t and best_t else None
            dig["ratio_vs_ddp_spread"] = dig[f"ratio_{best}_vs_ddp_spread"]
            dig["ratio_vs_ddp_of_medians"] = round(ddp_t / best_t, 3) if ddp_t and best_t else None
            if "sync" in modes and dig["sync"]["time_to_target_s"] and ddp_t:
                dig["ratio_sync_vs_ddp_both_training"] = round(ddp_t / dig["sync"]["time_to_target_both_s"], 3)
            res["digits"] = dig
    res["load_avg_before"], res["load_avg_after"] = load_before, load_average()
    res["cpu_during_run"] = meter.stop()
    res["quiet"] = is_quiet(res["cpu_during_run"])
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    report(res)
    if args.json:
        flat = {**res.get("push", {}), **res.get("digits", {}),
                **{k: res[k] for k in ("load_avg_before", "load_avg_after", "cpu_during_run", "quiet", "wall_s")}}
        if "push" in res and "digits" in res:  # both parts have one
            flat["push_wall_s"], flat["digits_wall_s"] = res["push"]["wall_s"], res["digits"]["wall_s"]
            flat["wall_s"] = res["wall_s"]
        print(json.dumps(flat))


def report(res: dict[str, Any]) -> None:
    if "push" in res:
        p = res["push"]
        print(f"(a) 2 workers x {p['push_bytes'] / MiB:.0f} MiB per round; {p['blocks']} cycles of one block per "
              f"peer ({p['warm_rounds_per_block']} untimed + {p['rounds_per_block']} timed rounds), order reversed "
              f"every other cycle")
        print(f"{'peer (rounds/s per block)':<34}{'median':>8}{'min':>8}{'p25':>8}{'p75':>8}{'max':>8}"
              f"{'ms/round':>10}{'CPU ms/round':>14}")
        for name, label in (("gloo", "gloo all_reduce"), ("ps_sync", "hmp PS push, sync (2 shards)"),
                            ("ps_async", "hmp PS push, async (2 shards)")):
            if f"{name}_rounds_per_s" in p:
                c = p.get(f"{name}_cpu_ms_per_round")
                b = p[f"{name}_rounds_per_s_blocks"]
                print(f"{label:<34}{b['median']:>8.1f}{b['min']:>8.1f}{b['p25']:>8.1f}{b['p75']:>8.1f}"
                      f"{b['max']:>8.1f}{p[f'{name}_ms_per_round']:>10.1f}{'-' if c is None else f'{c:.1f}':>14}")
        print("ratio: median of per-cycle ratios of adjacent blocks [min .. max] (IQR, cycles)")
        print(f"  ratio_vs_gloo_allreduce        {fmt_spread(p['ratio_vs_gloo_allreduce_spread'])} "
              f"(sync; target >= 0.8)")
        print(f"  ratio_async_vs_gloo_allreduce  {fmt_spread(p['ratio_async_vs_gloo_allreduce_spread'])}")
    if "digits" in res:
        d = res["digits"]
        print(f"\n(b) digits MLP, 2 workers x batch 32, time to {d['target_accuracy']:.0%} test accuracy "
              f"(evaluated every {d['eval_every_s']} s), {d['repeats']} runs per hmp mode, each between two "
              f"blocks of {d['ddp_runs_per_block']} DDP runs")
        print(f"{'peer':<18}{'time (s)':>9}{'both (s)':>9}{'skew (s)':>9}{'reached':>9}{'samples/s':>10}"
              f"{'final acc':>10}  all times (s)")
        fmt = lambda t: "-" if t is None else f"{t:.2f}"  # noqa: E731
        for name in ["ddp", *d["modes"]]:
            v = d[name]
            print(f"{('torch DDP (gloo)' if name == 'ddp' else 'hmp ' + name):<18}"
                  f"{fmt(v['time_to_target_s']):>9}{fmt(v.get('time_to_target_both_s')):>9}"
                  f"{fmt(v.get('startup_skew_s')):>9}{v['reached']:>5}/{v['runs']:<3}"
                  f"{v['samples_per_s'] or 0:>10.0f}{v['test_accuracy'] or 0:>10.3f}  {v['all_times_s']}")
        print("time: from the first worker's start of training; both: from when both train "
              "(skew: the second worker's later start)")
        print("ratio: DDP time (median of the DDP runs around an hmp run) / that run's time; median of runs "
              "[min .. max]")
        for m in d["modes"]:
            print(f"  ratio_{m}_vs_ddp{'':<{18 - len(m)}}{fmt_spread(d[f'ratio_{m}_vs_ddp_spread'])}")
        r = d.get("ratio_vs_ddp")
        print(f"ratio_vs_ddp = {r if r is not None else 'n/a'} (best mode {d['best_mode']}; target >= 1.0; "
              f"ratio of medians {d.get('ratio_vs_ddp_of_medians', 'n/a')}); sync from when both train: "
              f"{d.get('ratio_sync_vs_ddp_both_training', 'n/a')}")
        if d["repeats"] < 8:
            print(f"NOTE: {d['repeats']} hmp run(s) per mode. One run's time to target varies by tens of percent "
                  f"from run to run (all times above), so ratio_vs_ddp from so few runs is indicative only; "
                  f"`--skip push --repeats 8` or more for a figure to compare")
    print(cpu_line(res.get("cpu_during_run"), res["load_avg_before"], res["load_avg_after"], res["wall_s"]))


if __name__ == "__main__":
    main()
