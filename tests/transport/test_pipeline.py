"""Pipeline stages over real sockets in one process."""

from __future__ import annotations

import torch

from hmp.pipeline.microbatches import ExampleOrder
from tests.support import pipeline_config


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


