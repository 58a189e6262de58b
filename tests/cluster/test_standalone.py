"""A model that stands alone: a job with a ``file.py:Class`` model of the user's and ``[data] standardize`` trains,
the user's folder is deleted, and ``hmp.load_model(run)`` in a fresh interpreter, from another working directory,
gives on the raw test features exactly the report's final accuracy."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np

from hmp import job
from hmp.cluster import LocalCluster
from hmp.export import SOURCE_DIR, STANDARDIZE_FILE, load_model, model_info
from hmp.train.evaluate import evaluate
from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]

USER_MODEL = '''
import torch
from torch import nn


class Digits(nn.Module):
    """The user's own classifier, with a buffer of its own (a fixed temperature its logits are divided by)."""

    def __init__(self, hidden=32):
        super().__init__()
        self.hidden = nn.Linear(64, hidden)
        self.out = nn.Linear(hidden, 10)
        self.register_buffer("temperature", torch.tensor(2.0))

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x))) / self.temperature
'''

# What the user runs after the job, elsewhere: raw features in, predictions out.
USE_IT = '''
import json, sys
import numpy as np
import torch
import hmp

model = hmp.load_model(sys.argv[1])
d = np.load(sys.argv[2])
with torch.no_grad():
    predicted = model(torch.from_numpy(d["x"])).argmax(1).numpy()
print(json.dumps({"accuracy": float((predicted == d["y"]).mean()), "class": type(model).__name__,
                  "inner": type(getattr(model, "model", model)).__name__}))
'''


def user_job(folder: Path, run: Path) -> Path:
    folder.mkdir()
    (folder / "digits_model.py").write_text(USER_MODEL)
    path = folder / "job.toml"
    path.write_text(f"""
[job]
name = "standalone"
report_dir = "{run}"
heartbeat_interval_s = 1.0  # slow enough for a loaded machine

[model]
name = "digits_model.py:Digits"
args = {{ hidden = 32 }}

[data]
kind = "digits"
standardize = true

[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9

[train]
target_accuracy = 0.9
epochs = 20
max_seconds = 60
eval_every_s = 0.3
report_interval_s = 0.3

[cluster]
ps = 1
cpu_workers = 1
scheduler_port = {free_port()}
""")
    return path


async def test_load_model_after_the_users_folder_is_gone_predicts_raw_features(tmp_path):
    src, run, elsewhere = tmp_path / "user", tmp_path / "run", tmp_path / "elsewhere"
    cfg = job.load(user_job(src, run))
    async with LocalCluster(cfg) as cluster:
        report = await cluster.train(timeout_s=90)
    final = report["final"]
    raw_test = job.dataset(cfg.replace(data=dataclasses.replace(cfg.data, standardize=False)), "test")
    standardized = job.dataset(cfg, "test")
    assert not np.allclose(raw_test.x_test.numpy(), standardized.x_test.numpy())  # the scaling matters here
    np.savez(tmp_path / "raw_test.npz", x=raw_test.x_test.numpy(), y=raw_test.y_test.numpy())
    # In this process, before the folder goes: the bare model takes standardized rows, the loaded one raw rows.
    bare = load_model(run, raw_features=False)
    assert evaluate(bare, standardized.x_test, standardized.y_test)["test_accuracy"] == final["test_accuracy"]
    shutil.rmtree(src)
    elsewhere.mkdir()
    (elsewhere / "use_it.py").write_text(USE_IT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "use_it.py", str(run), str(tmp_path / "raw_test.npz")],
                                   cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    used = json.loads(done.stdout.strip().splitlines()[-1])
    assert used == {"accuracy": final["test_accuracy"], "class": "Standardized", "inner": "Digits"}, (used, final)
    assert final["test_accuracy"] >= 0.85, final
    info = model_info(run)
    assert info["model"]["name"] == f"{SOURCE_DIR}/digits_model.py:Digits"
    assert info["model_source"] == str(src / "digits_model.py") and info["standardize"]["file"] == STANDARDIZE_FILE
    assert (run / SOURCE_DIR / "digits_model.py").read_text() == USER_MODEL
    copy = tomllib.loads((run / "config.toml").read_text())
    assert copy["model"]["name"] == f"{SOURCE_DIR}/digits_model.py:Digits" and copy["nodes"][0]["id"] == "scheduler"
    again = job.load(run / "config.toml")  # the copy is a config that loads, its model found in the run folder
    assert job.sharded_model(again).model.__class__.__name__ == "Digits"
