"""Your own training loop as a worker of an hmp job (docs/own_loop.md).

    python examples/own_loop.py [CONFIG]

Starts the job's scheduler and PS shards (``hmp.LocalCluster``), then trains the digits MLP in the loop
below as the job's worker "mine" (``role = "user_worker"`` in conf/own_loop.toml): the loop is ours; hmp
hands out this worker's batches and exchanges the gradients in ``step()``.
"""

from __future__ import annotations

import asyncio
import sys

from torch.nn import functional as F

import hmp


async def main(config: str = "conf/own_loop.toml") -> dict:
    async with hmp.LocalCluster(config) as cluster:              # every daemon but the user workers
        async with hmp.Worker(cluster.cfg, "mine") as worker:     # joins, and holds the job's parameters
            model = worker.model
            async for x, y in worker.batches():                   # this worker's share of [data], each epoch
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                if not await worker.step(loss):                   # push the gradients, load the new values
                    break
            steps = worker.steps
        report = await cluster.train()                            # the shards' final parameters, evaluated
    print(f"{steps} steps of our own loop; test accuracy {report['final']['test_accuracy']:.3f}")
    print(f"workers in the report: {', '.join(report['workers'])}")
    return report


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:2]))
