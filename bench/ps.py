"""Parameter-server benchmark: hmp's PS against torch.distributed (gloo), all in one run.

(a) Push rounds. Two worker processes each push 16 MiB of float32 gradients through two real PS
    shard daemons (``python -m hmp.nodes.main ps``; 1 MiB chunks, 8 per shard) and get the new
    values back (``PSClient.push``): ``ps_shm`` (sync, through shared memory, docs/shm.md: the
    pushes and replies carry headers only), ``ps_sync`` and ``ps_async`` (frames over loopback TCP,
    ``[shm] enabled = false``); against two processes doing gloo ``all_reduce`` of a 16 MiB float32
    tensor. A round is one push (one all_reduce) by each of the two workers; rounds/s = rounds /
    the slower worker's time. Every peer's processes start once and are warmed up; then
    ``--blocks`` cycles of one short block per peer (``--warm`` untimed + ``--rounds`` timed
    rounds) in the order ps_async, ps_sync, gloo, ps_shm, reversed every other cycle (gloo is next
    to both sync peers). Each cycle gives one ratio from two adjacent blocks; the ratios are the
    medians of those per-cycle ratios (``_spread``: min, quartiles, max):
    ``ratio_vs_gloo_allreduce`` (ps_shm; ps_sync with ``--no-shm``), ``ratio_tcp_vs_gloo_allreduce``
    (ps_sync) and ``ratio_async_vs_gloo_allreduce`` (ps_async).
    The cost of replication (``[ps] replicas = 2``, docs/resilience.md): ``ps_replicated`` is ps_async
    with a backup of every chunk on the other shard (each push is forwarded to the backup and answered
    once the backup applied it), timed in the block next to ps_async: ``replicated_round_ms`` and
    ``replication_cost_ratio`` (median per-cycle ratio of replicated / unreplicated time per round;
    1.0 = free). ``--no-replicated`` leaves it out.
(b) End-to-end training, ``bench/train.py`` (see its docstring): a throughput-bound job (a
    14.7 M-parameter MLP on generated dense data, 2 workers x batch 64) trained by hmp
    (``LocalCluster``: scheduler, PS shards, 2 ``cpu_worker`` s; ``--modes``, default sync)
    against torch DistributedDataParallel (gloo) on two processes with the same model, seed, data
    slices, optimizer and batch size. DDP's processes stay up; every hmp run (a fresh cluster)
    sits between two blocks of ``--ddp-runs`` DDP runs. Steady-state samples/s (start-up and the
    first seconds excluded) -> ``ratio_vs_ddp`` (hmp best mode / DDP, means over the interleaved
    runs; ``_spread``: the per-run ratios, each hmp run against the DDP runs around it), and time
    to a target training loss -> ``ratio_time_to_loss_vs_ddp`` (DDP time / hmp time).

    python bench/ps.py [--json] [--quick] [--blocks N] [--rounds N] [--warm N] [--repeats N] [--no-replicated]
                       [--ddp-runs N] [--modes sync,async] [--epochs N] [--target-loss L] [--skip push|train]

With ``--json`` the last line is one JSON object with every figure: ``ratio_vs_gloo_allreduce``
(sync PS rounds/s over shared memory / gloo rounds/s), ``ratio_tcp_vs_gloo_allreduce`` (over TCP), ``ratio_vs_ddp`` (hmp best-mode samples/s / DDP samples/s),
``ratio_time_to_loss_vs_ddp``, their ``*_spread`` objects, per-peer ``*_blocks`` summaries and (b)'s
per-peer objects (``ddp``, ``sync``, ...), and the machine's load during the run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
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

from _stats import (free_port, guard, CpuMeter, ProcessGroup, alternate, cpu_line, fmt_spread, is_quiet, load_average, quantile,  # noqa: E402
                    ratios, spread, summary)
import train  # noqa: E402 - part (b), end-to-end training
from train import REPLY_TIMEOUT_S  # noqa: E402

MiB = 1 << 20
# deep_mlp with depth 0 is one Linear(4095, 1024): 4095 * 1024 weights + 1024 biases = 4 Mi float32,
# exactly 16 MiB of parameters, cut into 16 chunks of 1 MiB.
PUSH_MODEL = {"in_features": 4095, "width": 1, "depth": 0, "classes": 1024}
PUSH_NUMEL = 4095 * 1024 + 1024
# Data the push model fits (the config loader checks it); only the scheduler loads it, and nothing trains on it.
PUSH_DATA = 'kind = "synthetic"\nargs = { n = 256, n_features = 4095, num_classes = 1024 }'
WORKERS = ("w0", "w1")


def write_config(folder: Path, *, consistency: str, model: str, model_args: dict[str, Any], chunk_bytes: int,
                 workers: list[tuple[str, str]], target: float = 0.0, eval_every_s: float = 1.0,
                 epochs: int = 20, max_seconds: float = 600.0, join_timeout_s: float = 60.0,
                 optimizer: str = 'name = "sgd"\nlr = 0.05\nmomentum = 0.9', data: str = 'kind = "digits"') -> Path:
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
{data}

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


def bench_push(blocks: int, rounds: int, warm: int, modes: list[str], tmp: Path, shm: bool = True,
               replicated: bool = True) -> dict[str, Any]:
    """Rounds/s of each peer: ``blocks`` cycles of one short block (``rounds`` timed rounds after
    ``warm`` untimed ones) per peer, in the order ps_replicated, ps_async, ps_sync, gloo, ps_shm
    reversed every other cycle, so that gloo is always adjacent to both sync peers and ps_replicated
    to ps_async; per-cycle ratios and their spread. ``modes`` are the TCP peers' consistencies;
    ``shm`` adds ps_shm (sync, shared memory); ``replicated`` adds ps_replicated (async, TCP,
    ``[ps] replicas = 2``; needs "async" in ``modes``)."""
    if warm + rounds > 60:
        raise ValueError("at most 60 rounds per block, warm-up included (gloo's summed values must stay finite)")
    from hmp.config import load

    daemons: dict[str, Daemons] = {}
    peers: dict[str, ProcessGroup] = {}
    t0 = time.perf_counter()
    # peer -> (consistency, shared memory, replicas); listed in block order
    replicated = replicated and "async" in modes
    ps_peers = {"ps_replicated": ("async", False, 2)} if replicated else {}
    ps_peers.update({f"ps_{m}": (m, False, 1) for m in reversed(modes)})
    if shm:
        ps_peers["ps_shm"] = ("sync", True, 1)
    order = [n for n in ps_peers if not ps_peers[n][1]] + ["gloo"] + [n for n in ps_peers if ps_peers[n][1]]
    try:
        port = free_port()
        peers["gloo"] = ProcessGroup("gloo", _gloo_worker, lambda r: (r, port, PUSH_NUMEL), timeout_s=REPLY_TIMEOUT_S)
        for name, (mode, use_shm, replicas) in ps_peers.items():
            folder = tmp / f"push-{name}"
            folder.mkdir()
            cfg_path = write_config(folder, consistency=mode, model="deep_mlp", model_args=PUSH_MODEL,
                                    chunk_bytes=MiB, workers=[(w, "") for w in WORKERS], join_timeout_s=3600,
                                    optimizer='name = "sgd"\nlr = 0.01\nmomentum = 0.9', data=PUSH_DATA)
            text = cfg_path.read_text().replace("[ps]\n", f"[ps]\nreplicas = {replicas}\n")
            cfg_path.write_text(text + f"\n[shm]\nenabled = {str(use_shm).lower()}\n")
            cfg = load(cfg_path)
            shards = [(s.id, s.bind) for s in cfg.shards]
            daemons[name] = Daemons(cfg_path, [("scheduler", "scheduler"), ("ps", "ps0"), ("ps", "ps1")],
                                    folder / "logs")
            peers[name] = ProcessGroup(name, _ps_worker, lambda r, c=str(cfg_path), s=shards: (c, WORKERS[r], s),
                                       timeout_s=REPLY_TIMEOUT_S)
        for p in peers.values():
            p.ready()
        for p in peers.values():  # warm-up of every peer before anything is timed
            p.ask("run", 0, max(5, rounds))
        times: dict[str, list[float]] = {name: [] for name in order}
        cpu: dict[str, list[float]] = {name: [] for name in order}
        pids = {name: [pr.pid for pr in p.procs] for name, p in peers.items()}
        for name, d in daemons.items():
            pids[name] += d.pids  # the shards' (and scheduler's) CPU counts too
        for b in range(blocks):
            for name in alternate(order, b):  # gloo next to both sync peers, each first every other cycle
                for d in daemons.values():
                    d.check()
                c0 = cpu_seconds(pids[name])
                times[name].append(max(peers[name].ask("run", warm, rounds)))
                c1 = cpu_seconds(pids[name])
                if c0 is not None and c1 is not None:
                    cpu[name].append((c1 - c0) / (warm + rounds))
    finally:
        for p in peers.values():
            p.close()
        for d in daemons.values():
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
    if replicated:  # time per round replicated / unreplicated, adjacent blocks of each cycle
        rs = ratios(rps["ps_async"], rps["ps_replicated"])
        res["replicated_round_ms"] = res["ps_replicated_ms_per_round"]
        res["unreplicated_round_ms"] = res["ps_async_ms_per_round"]
        res["replication_cost_ratio"] = round(quantile(rs, 0.5), 3)
        res["replication_cost_ratio_spread"] = spread(rs)
    keys = {"ps_shm": "ratio_vs_gloo_allreduce", "ps_sync": "ratio_tcp_vs_gloo_allreduce"}
    for name in ps_peers:
        if name == "ps_replicated":
            continue
        key = keys.get(name, f"ratio_{name.removeprefix('ps_')}_vs_gloo_allreduce")
        rs = ratios(rps[name], rps["gloo"])
        res[key] = round(quantile(rs, 0.5), 3)
        res[f"{key}_spread"] = spread(rs)
    if not shm and "ratio_tcp_vs_gloo_allreduce" in res:  # the headline without shared memory: TCP
        res["ratio_vs_gloo_allreduce"] = res["ratio_tcp_vs_gloo_allreduce"]
        res["ratio_vs_gloo_allreduce_spread"] = res["ratio_tcp_vs_gloo_allreduce_spread"]
    res["headline_peer"] = "ps_shm" if shm else "ps_sync"
    return res


# ----------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    ap.add_argument("--blocks", type=int, default=30, help="(a) alternating cycles: one timed block per peer each")
    ap.add_argument("--rounds", type=int, default=4, help="(a) timed rounds per block (warm + rounds <= 60)")
    ap.add_argument("--warm", type=int, default=1, help="(a) untimed rounds before each block")
    ap.add_argument("--no-replicated", action="store_true",
                    help="(a) leave out ps_replicated (async with [ps] replicas = 2: the cost of replication)")
    ap.add_argument("--no-shm", action="store_true",
                    help="(a) leave out the shared-memory peer (ratio_vs_gloo_allreduce is then TCP's)")
    train.add_args(ap)
    ap.add_argument("--skip", choices=["push", "train", "digits"], default=None,
                    help="leave one part out (digits: the old name of train)")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.rounds, args.repeats, args.ddp_runs = 3, 3, 1, 1
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    load_before = load_average()
    meter = CpuMeter()
    meter.start()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hmp-bench-ps-") as d:
        tmp = Path(d)
        if args.skip != "push":
            res["push"] = bench_push(args.blocks, args.rounds, args.warm, ["sync", "async"], tmp, shm=not args.no_shm,
                                     replicated=not args.no_replicated)
        if args.skip not in ("train", "digits"):
            res["train"] = train.run_from_args(args, tmp)
    res["load_avg_before"], res["load_avg_after"] = load_before, load_average()
    res["cpu_during_run"] = meter.stop()
    res["quiet"] = is_quiet(res["cpu_during_run"])
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    report(res)
    if args.json:
        flat = {**res.get("push", {}), **res.get("train", {}),
                **{k: res[k] for k in ("load_avg_before", "load_avg_after", "cpu_during_run", "quiet", "wall_s")}}
        if "push" in res and "train" in res:  # both parts have one
            flat["push_wall_s"], flat["train_wall_s"] = res["push"]["wall_s"], res["train"]["wall_s"]
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
        for name, label in (("gloo", "gloo all_reduce"), ("ps_shm", "hmp PS push, sync, shared memory"),
                            ("ps_sync", "hmp PS push, sync, TCP"), ("ps_async", "hmp PS push, async, TCP"),
                            ("ps_replicated", "hmp PS push, async, TCP, replicas 2")):
            if f"{name}_rounds_per_s" in p:
                c = p.get(f"{name}_cpu_ms_per_round")
                b = p[f"{name}_rounds_per_s_blocks"]
                print(f"{label:<34}{b['median']:>8.1f}{b['min']:>8.1f}{b['p25']:>8.1f}{b['p75']:>8.1f}"
                      f"{b['max']:>8.1f}{p[f'{name}_ms_per_round']:>10.1f}{'-' if c is None else f'{c:.1f}':>14}")
        print("ratio: median of per-cycle ratios of adjacent blocks [min .. max] (IQR, cycles)")
        print(f"  ratio_vs_gloo_allreduce        {fmt_spread(p['ratio_vs_gloo_allreduce_spread'])} "
              f"({p['headline_peer']}; target >= 1.0)")
        for key, what in (("ratio_tcp_vs_gloo_allreduce", "sync, TCP"), ("ratio_async_vs_gloo_allreduce", "async, TCP")):
            if f"{key}_spread" in p:
                print(f"  {key:<31}{fmt_spread(p[f'{key}_spread'])} ({what})")
        if "replication_cost_ratio_spread" in p:
            print(f"  {'replication_cost_ratio':<31}{fmt_spread(p['replication_cost_ratio_spread'])} (async TCP: "
                  f"time per round, replicas 2 / replicas 1; {p['replicated_round_ms']:.1f} vs "
                  f"{p['unreplicated_round_ms']:.1f} ms)")
    if "train" in res:
        print()
        train.report(res["train"])
    print(cpu_line(res.get("cpu_during_run"), res["load_avg_before"], res["load_avg_after"], res["wall_s"]))


if __name__ == "__main__":
    main()
