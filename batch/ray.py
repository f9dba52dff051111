"""`moe-serve batch --ray [ADDRESS]`: chunks of the batch file run on Ray actors, each starting the models'
engines once; the driver appends results as chunks finish, so resume works exactly as in a local run."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from moe_serve.batch.jsonl import BatchItem, LineResult
from moe_serve.batch.runner import ChunkRunner, EnginePool, process_chunk
from moe_serve.config import EngineConfig
from moe_serve.errors import MoEServeError


class BatchWorker:
    """One per Ray actor: its own engines and a single torch thread (Ray gives it one CPU)."""

    def __init__(self, engine_config: EngineConfig) -> None:
        import torch

        torch.set_num_threads(1)
        self.pool = EnginePool(engine_config)

    def run(self, items: list[BatchItem]) -> list[LineResult]:
        return process_chunk(self.pool, items)


def ray_chunk_runner(address: str | None, num_workers: int, engine_config: EngineConfig) -> ChunkRunner:
    try:
        import ray
    except ModuleNotFoundError:
        raise MoEServeError("--ray needs the optional dependency ray: pip install 'moe-serve[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    worker_class = ray.remote(num_cpus=1)(BatchWorker)
    workers = [worker_class.remote(engine_config) for _ in range(num_workers)]

    def run(chunks: Iterable[list[BatchItem]]) -> Iterator[list[LineResult]]:
        queue = iter(chunks)
        in_flight = {}
        try:
            for worker in workers:  # one chunk per worker at a time keeps every worker busy
                chunk = next(queue, None)
                if chunk is not None:
                    # ray types `.remote` on @ray.method methods only, which need ray imported (it is optional).
                    in_flight[worker.run.remote(chunk)] = worker  # type: ignore[attr-defined]
            while in_flight:
                done, _ = ray.wait(list(in_flight), num_returns=1)
                worker = in_flight.pop(done[0])
                yield ray.get(done[0])
                chunk = next(queue, None)
                if chunk is not None:
                    in_flight[worker.run.remote(chunk)] = worker  # type: ignore[attr-defined]  # as above
        finally:
            for worker in workers:
                # ActorClass.remote is typed ActorHandle | type[T] (the latter for method completion); it
                # returns an ActorHandle, which is what kill takes.
                ray.kill(worker)  # type: ignore[arg-type]
            if started_here:
                ray.shutdown()

    return run
