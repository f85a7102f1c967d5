"""A run as a ``torch.utils.data.IterableDataset``: ``iter_batches`` in each data loader worker, as tensors."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info


class RecordedBatches(IterableDataset):
    """Batches of a run's steps as dicts of tensors (string columns such as ``agent_id`` stay numpy).

    Holds only the run's path and the options (a worker process pickles it and opens the run itself). With
    ``DataLoader(dataset, batch_size=None, num_workers=N)`` worker i reads every N-th block from the i-th.
    """

    def __init__(self, path: str, batch_size: int = 1024, *, opener: Callable[[str], Any], **options: Any) -> None:
        super().__init__()
        if "shard" in options:
            raise TypeError("RecordedBatches shards by data loader worker itself; leave out shard=")
        # opener: ``read.run.open_run``, passed in (a module-level function pickles by name) rather than imported
        self.path, self.batch_size, self.options, self.opener = path, batch_size, options, opener

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = get_worker_info()
        shard = (worker.id, worker.num_workers) if worker is not None and worker.num_workers > 1 else None
        with self.opener(self.path) as run:
            for batch in run.iter_batches(self.batch_size, shard=shard, **self.options):
                yield {k: torch.from_numpy(v) if v.dtype.kind in "biuf" else v for k, v in batch.items()}

    def __repr__(self) -> str:
        return f"RecordedBatches({self.path!r}, batch_size={self.batch_size})"


__all__ = ["RecordedBatches"]
