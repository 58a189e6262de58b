"""HFTA benchmark: B fused models against B models trained one by one, and against B processes.

For each model (the digits MLP of hmp.models, and a small CNN on the same 8x8 digits images)
and each B in {1, 2, 4, 8, 16}, the same total work (B members x STEPS SGD steps of a batch of
BATCH samples, per-member learning rates, momentum 0.9) is done three ways:

- ``fused``:  one ``FusedArray`` (all B members in one fused model), this process, 2 threads;
- ``serial``: B plain ``torch.nn`` models with ``torch.optim.SGD``, trained one after another
              in this process, 2 threads;
- ``procs``:  B plain models, one per process, all at once; the 2 cores split fairly
              (each process gets max(1, 2 // B) threads). Process start-up and imports are not
              timed: every process builds its model and warms up, then all start together.

Throughput is samples/s = B * STEPS * BATCH / wall seconds, the median of REPEATS runs (the
machine is shared and noisy). Run: ``python bench/hfta.py [--json] [--quick]``; with ``--json``
the last line is one JSON object holding every figure and ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hmp.hfta import FusedArray  # noqa: E402
from hmp.models import digits_mlp  # noqa: E402

CORES = 2
TARGETS = {"mlp": 4.0, "cnn": 2.0}  # speedup_vs_serial wanted at B = 8


def digits_cnn() -> nn.Sequential:
    """A small CNN for 8x8 digits: ``[N, 1, 8, 8]`` in, ``[N, 10]`` logits out."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 16 x 4 x 4
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 2 x 2
        nn.Flatten(), nn.Linear(128, 10),
    )


MODELS = {"mlp": (digits_mlp, (64,)), "cnn": (digits_cnn, (1, 8, 8))}


@dataclass(frozen=True, slots=True)
class Config:
    """What one benchmark run measures."""

    batch: int = 32          # samples per step per member
    mlp_steps: int = 60      # SGD steps per member per timed run (MLP)
    cnn_steps: int = 30      # SGD steps per member per timed run (CNN)
    repeats: int = 5         # timed runs per figure; the median is reported (the machine is noisy)
    warmup: int = 3          # untimed steps before each timed run
    Bs: tuple[int, ...] = (1, 2, 4, 8, 16)

    def steps(self, model: str) -> int:
        return self.mlp_steps if model == "mlp" else self.cnn_steps


def digits_batches(shape: tuple[int, ...], batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of scikit-learn's digits (pixels scaled to [0, 1]) shaped ``[batch, *shape]``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        idx = torch.randint(0, len(x), (batch,), generator=g)
        out.append((x[idx].reshape(batch, *shape).contiguous(), y[idx]))
    return out


def member_lr(b: int) -> float:
    return 0.01 * (1 + b % 4)


# ---------------------------------------------------------------------------------------------
# the three ways


def train_plain(model: nn.Module, opt: torch.optim.Optimizer, batches, steps: int) -> None:
    for i in range(steps):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()


def run_serial(name: str, B: int, cfg: Config) -> float:
    """Seconds to train B plain models one after another (median of repeats)."""
    factory, shape = MODELS[name]
    steps = cfg.steps(name)
    batches = digits_batches(shape, cfg.batch, 16)
    times = []
    for _ in range(cfg.repeats):
        models = [factory() for _ in range(B)]
        opts = [torch.optim.SGD(m.parameters(), lr=member_lr(b), momentum=0.9) for b, m in enumerate(models)]
        for m, o in zip(models, opts):
            train_plain(m, o, batches, cfg.warmup)
        t0 = time.perf_counter()
        for m, o in zip(models, opts):
            train_plain(m, o, batches, steps)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_fused(name: str, B: int, cfg: Config) -> float:
    """Seconds to train B members as one FusedArray (median of repeats)."""
    factory, shape = MODELS[name]
    steps = cfg.steps(name)
    batches = digits_batches(shape, cfg.batch, 16)
    settings = [{"lr": member_lr(b), "momentum": 0.9} for b in range(B)]
    times = []
    for _ in range(cfg.repeats):
        array = FusedArray(factory, settings, optimizer="sgd")
        for i in range(cfg.warmup):
            array.step(*batches[i % len(batches)])
        t0 = time.perf_counter()
        for i in range(steps):
            array.step(*batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _proc_worker(conn) -> None:
    """A long-lived worker: per job, build one plain model, warm up, wait for 'go', train."""
    while True:
        job = conn.recv()
        if job is None:
            conn.close()
            return
        name, b, steps, threads, cfg_dict = job
        cfg = Config(**cfg_dict)
        torch.set_num_threads(threads)
        factory, shape = MODELS[name]
        batches = digits_batches(shape, cfg.batch, 16)
        model = factory()
        opt = torch.optim.SGD(model.parameters(), lr=member_lr(b), momentum=0.9)
        train_plain(model, opt, batches, cfg.warmup)
        conn.send("ready")
        conn.recv()  # go
        train_plain(model, opt, batches, steps)
        conn.send("done")


class ProcessPeers:
    """Up to max(B) worker processes, started once (spawn) and reused for every B."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_proc_worker, args=(child,), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, name: str, B: int, cfg: Config) -> float:
        """Seconds for B processes to train one model each, all at once (median of repeats)."""
        threads = max(1, CORES // B)
        times = []
        for _ in range(cfg.repeats):
            conns = self.conns[:B]
            for b, c in enumerate(conns):
                c.send((name, b, cfg.steps(name), threads, asdict(cfg)))
            for c in conns:
                if c.recv() != "ready":
                    raise RuntimeError("benchmark worker failed to get ready")
            t0 = time.perf_counter()
            for c in conns:
                c.send("go")
            for c in conns:
                c.recv()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
            c.close()
        for p in self.procs:
            p.join(timeout=30)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--quick", action="store_true", help="a ~30 s smoke run (fewer steps, B up to 8)")
    ap.add_argument("--no-procs", action="store_true", help="skip the B-processes peer")
    args = ap.parse_args(argv)
    cfg = Config(mlp_steps=20, cnn_steps=6, repeats=1, Bs=(1, 4, 8)) if args.quick else Config()
    torch.set_num_threads(CORES)
    peers = None if args.no_procs else ProcessPeers(max(cfg.Bs))
    results = []
    try:
        for name in MODELS:
            for B in cfg.Bs:
                samples = B * cfg.steps(name) * cfg.batch
                torch.set_num_threads(CORES)
                serial = run_serial(name, B, cfg)
                fused = run_fused(name, B, cfg)
                procs = peers.run(name, B, cfg) if peers else float("nan")
                torch.set_num_threads(CORES)
                row = {
                    "model": name, "B": B, "samples": samples,
                    "serial_sps": samples / serial, "fused_sps": samples / fused,
                    "procs_sps": samples / procs,
                    "speedup_vs_serial": serial / fused, "speedup_vs_procs": procs / fused,
                }
                results.append(row)
                print(f"{name:4s} B={B:<3d} serial {row['serial_sps']:9.0f}/s  fused {row['fused_sps']:9.0f}/s  "
                      f"procs {row['procs_sps']:9.0f}/s  speedup_vs_serial {row['speedup_vs_serial']:5.2f}  "
                      f"speedup_vs_procs {row['speedup_vs_procs']:5.2f}", flush=True)
    finally:
        if peers:
            peers.close()
    at8 = {r["model"]: r["speedup_vs_serial"] for r in results if r["B"] == 8}
    out = {
        "bench": "hfta", "config": asdict(cfg), "cores": CORES, "torch": torch.__version__,
        "results": results,
        "targets_speedup_vs_serial_at_B8": TARGETS,
        "speedup_vs_serial_at_B8": at8,
        "targets_met": {m: at8.get(m, 0.0) >= t for m, t in TARGETS.items()} if 8 in cfg.Bs else None,
    }
    print()
    print("speedup_vs_serial at B=8: " + ", ".join(f"{m} {v:.2f} (target {TARGETS[m]})" for m, v in at8.items()))
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
