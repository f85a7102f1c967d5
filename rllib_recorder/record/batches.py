"""Old API stack samples (SampleBatch, MultiAgentBatch) as columnar chunks."""

from __future__ import annotations

from typing import Any

import numpy as np

from rllib_recorder.format.chunks import DEFAULT_AGENT, EPS_ID_DTYPE, Chunk, Stream, uint8_stream
from rllib_recorder.record.convert import ConvertOptions, flatten_value, fragment_columns, infos_to_json

# SampleBatch columns with a fixed place in the schema; every other per-row column
# of an old-stack batch is kept under extra_model_outputs/.
_OLD_STACK_KNOWN = {
    "obs", "new_obs", "actions", "rewards", "terminateds", "truncateds", "infos",
    "eps_id", "t", "unroll_id", "agent_index", "weights_seq_no", "dones",
}  # fmt: skip


def batch_to_chunk(
    batch: Any, options: ConvertOptions = ConvertOptions(), policy_version: int = -1,
    sampled_at_s: float = 0.0,
) -> Chunk:
    """Converts an old-stack ``SampleBatch`` or ``MultiAgentBatch`` to a chunk.

    A ``MultiAgentBatch`` gives one stream per policy; its rows keep their
    ``agent_index``. ``policy_version`` is the worker's ``weights_seq_no``.
    """
    if hasattr(batch, "policy_batches"):
        policy_batches, env_steps = batch.policy_batches, int(batch.env_steps())
    else:
        policy_batches, env_steps = {"default_policy": batch}, len(batch["rewards"])
    single_agent = list(policy_batches) == ["default_policy"] and not np.any(
        np.asarray(policy_batches["default_policy"].get("agent_index", 0))
    )
    streams = {
        DEFAULT_AGENT if single_agent else str(policy_id): _sample_batch_stream(
            policy_batch, str(policy_id), options, policy_version
        )
        for policy_id, policy_batch in policy_batches.items()
        if len(policy_batch["rewards"])
    }
    if options.encode_images:
        streams = {key: uint8_stream(stream) for key, stream in streams.items()}
    return Chunk(streams=streams, env_steps=env_steps, sampled_at_s=sampled_at_s)


def _sample_batch_stream(batch: Any, policy_id: str, options: ConvertOptions, version: int) -> Stream:
    n = len(batch["rewards"])
    containers: dict[str, str] = {}
    steps = flatten_value("obs", batch["obs"], containers)
    if "actions" in batch:  # the old stack's evaluation batches (explore=False) come without them
        steps.update(flatten_value("actions", batch["actions"], containers))
    steps["rewards"] = np.asarray(batch["rewards"])
    steps["terminateds"] = np.asarray(batch["terminateds"], dtype=bool)
    steps["truncateds"] = np.asarray(batch["truncateds"], dtype=bool)
    raw_ids = np.asarray(batch["eps_id"])
    steps["eps_id"] = np.array([str(e).encode() for e in raw_ids], dtype=EPS_ID_DTYPE) if n else raw_ids
    steps["t"] = np.asarray(batch["t"], dtype=np.int64)
    steps["weights_seq_no"] = np.full(n, version, dtype=np.int64)
    if "agent_index" in batch:
        steps["agent_index"] = np.asarray(batch["agent_index"], dtype=np.int64)
    if options.record_extra_model_outputs:
        for key in sorted(k for k in batch.keys() if k not in _OLD_STACK_KNOWN):
            value = batch[key]
            if len(value) == n and not key.startswith("state_"):
                steps.update(flatten_value(f"extra_model_outputs/{key}", value, containers))
    # Fragments: maximal runs of one episode with consecutive t.
    ids, t = raw_ids, steps["t"]
    breaks = np.flatnonzero((ids[1:] != ids[:-1]) | (t[1:] != t[:-1] + 1)) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    ends = np.concatenate([breaks, [n]]).astype(np.int64)
    last = ends - 1
    rewards = steps["rewards"].astype(np.float64)
    fragments = fragment_columns(
        eps_id=steps["eps_id"][starts], num_rows=list(ends - starts), t_start=list(t[starts]),
        terminated=list(steps["terminateds"][last]), truncated=list(steps["truncateds"][last]),
        ret=[float(rewards[s:e].sum()) for s, e in zip(starts, ends)],
        module_id=[policy_id] * len(starts), has_last_obs=[True] * len(starts),
    )
    for path, column in flatten_value("obs", batch["new_obs"], containers).items():
        fragments["last_" + path] = column[last]
    for path, kind in list(containers.items()):
        if path.startswith("obs"):
            containers["last_" + path] = kind
    if options.record_infos and "infos" in batch:
        # Old-stack infos come with new_obs; the fragment's first observation has none.
        infos = list(batch["infos"])
        fragments["infos"] = np.array(
            [infos_to_json([None] + infos[s:e]) for s, e in zip(starts, ends)], dtype=object
        )
    return Stream(steps=steps, fragments=fragments, containers=containers)
