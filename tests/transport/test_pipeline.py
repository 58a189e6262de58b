"""Pipeline stages over real sockets in one process."""

from __future__ import annotations

import torch

from hmp.job import loads
from hmp.pipeline.schedule import ExampleOrder
from tests.support import free_port


async def test_stage_worker_keeps_messages_that_arrive_before_its_assignment(tmp_path):
    """A neighbour that got its stage_assign first may send step 0's activations before this worker has its own:
    they are held and replayed once the assignment arrives (dropping them stalled the pipeline for good), while
    messages of an older plan are dropped."""
    from hmp import job
    from hmp.messages import Activations, StageAssign
    from hmp.nodes.stage_worker import StageWorkerNode

    class FakePS:
        keys = ()
        shard_addresses = ()

        def restrict(self, keys):
            self.restricted = tuple(keys)

        def reset_buffers(self):
            pass

        async def pull(self):
            pass

    class FakePeer:
        async def connect(self):
            pass

    threads = torch.get_num_threads()
    try:
        cfg = pipeline_config(tmp_path)
        node = StageWorkerNode(cfg, "accel0")
    finally:
        torch.set_num_threads(threads)
    node.sharded, node.ps = job.sharded_model(cfg), FakePS()
    node.order = ExampleOrder(4096, 512, 4, 0)
    node.client = lambda address: FakePeer()

    def act(plan, m):
        return Activations(sender="cpu1", plan=plan, step=0, micro_batch=m, values=torch.zeros(128, 256),
                           labels=torch.zeros(128, dtype=torch.int64))

    early, stale = act(2, 1), act(1, 3)
    await node.handle(early)
    await node.handle(stale)
    assert node.held == [early, stale]
    await node.handle(StageAssign(plan=2, stage=1, stages=2, start=1, stop=6, index=0, width=1, prev=("tcp://a:1",),
                                  micro_batches=4, batch_size=512, start_step=0, steps=10))
    assert node.compute is not None and node.held == []
    assert node.events.get_nowait() is early and node.events.empty()


def pipeline_config(tmp, *, epochs=2, max_seconds=25.0, workers=("cpu0", "cpu1", "accel0"), join_wait_s=10.0,
                    samples=16000):
    """The click model as a planned pipeline on loopback: embeddings on the measured 'cpu' type, the MLP on the
    scaled 'accel' type (the cheapest plan), parameters on two PS shards. Batch 512 and an accel at $0.04/h, 20x slower at lookups, keep
    the split clearly cheapest (by ~50%) under the cost model's per-message overhead, even when the profile is
    taken on a loaded machine; at batch 256 one cpu stage is cheaper (four messages each way per boundary)."""
    text = f"""
[job]
name = "pipe"
report_dir = "{tmp / 'run'}"
heartbeat_interval_s = 0.5
join_timeout_s = 60

[model]
name = "click_model"
args = {{ fields = 16, buckets = 1000, dim = 16, hidden = [256, 128] }}

[data]
kind = "click"
samples = {samples}
args = {{ fields = 16, buckets = 1000 }}

[optimizer]
name = "adam"
lr = 0.003

[train]
batch_size = 512
epochs = {epochs}
max_seconds = {max_seconds}
eval_every_s = 0.5
report_interval_s = 0.3

[ps]
chunk_bytes = 65536

[placement]
enabled = true
planner = "bruteforce"
micro_batches = 4
min_throughput = 2000.0
bandwidth_bytes_per_s = 1e10
join_wait_s = {join_wait_s}
profile_repeats = 7
resources = [
  {{ name = "cpu", price_per_hour = 0.17 }},
  {{ name = "accel", price_per_hour = 0.04, measured = false, speed_scale = {{ sparse = 0.05, dense = 8.0, elementwise = 4.0 }} }},
]

[[nodes]]
id = "scheduler"
role = "scheduler"
bind = "tcp://127.0.0.1:{free_port()}"

[[nodes]]
id = "ps0"
role = "ps"

[[nodes]]
id = "ps1"
role = "ps"
"""
    for w in workers:
        role, res = ("gpu_worker", "accel") if w.startswith("accel") else ("cpu_worker", "cpu")
        text += f'\n[[nodes]]\nid = "{w}"\nrole = "{role}"\nresource = "{res}"\n' + (
            'device = "cpu"\n' if role == "gpu_worker" else "")
    path = tmp / "pipe.toml"
    path.write_text(text)
    return loads(text, str(path))
