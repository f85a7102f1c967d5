"""How an env runner finds its writer: the binding the driver sends it, and the runner-to-writer assignment."""

from __future__ import annotations

from dataclasses import dataclass, field

import ray

from rllib_recorder.config import RecorderConfig
from rllib_recorder.format import layout


def current_node_id() -> str:
    """The Ray node id of the calling process."""
    return ray.get_runtime_context().get_node_id()


def assign_writer(worker_index: int, is_evaluation: bool, num_writers: int) -> int:
    """The writer that owns env runner ``worker_index``'s file.

    Training runners 1..N go round-robin from writer 0; evaluation runners start
    half-way round, so that the two kinds spread over the pool.
    """
    offset = num_writers // 2 if is_evaluation else 0
    return (max(worker_index - 1, 0) + offset) % num_writers


@dataclass(frozen=True)
class Binding:
    """What an env runner needs to hand its samples to its run's writers (sent to it by the driver)."""

    run_id: str
    run_dir: str
    namespace: str
    num_writers: int
    config: RecorderConfig
    # node id -> names of the writers on that node; the first entry is the driver's node
    node_writers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # node id -> the tag in the names of the files written there ('' on the driver's node)
    node_tags: dict[str, str] = field(default_factory=dict)

    def stem_for(self, node_id: str, worker_index: int, is_evaluation: bool) -> str | None:
        """The spool stem (file name without ``.h5``) of env runner ``worker_index`` on ``node_id``; None while
        that node has no writers yet (the driver starts them before it binds the runner)."""
        tag = self.node_tags.get(node_id)
        if tag is None:
            return None
        return layout.file_name(worker_index, is_evaluation, tag)[: -len(".h5")]
