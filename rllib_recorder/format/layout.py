"""What a worker file holds, by name: format and schema version, attributes, tables and columns, file names."""

from __future__ import annotations

from typing import Any

import numpy as np

from rllib_recorder.errors import SchemaError

FORMAT_NAME = "rllib_recorder"

SCHEMA_VERSION = "3.0"

# Majors this reader reads: 2.0 may store frame stacks as their newest frames (FRAME_STACK_ATTR), which a 1.x
# reader would return as they are stored; 3.0 may store image columns as frame deltas (frames.DELTA_ATTR), which
# a 2.x reader would return as they are stored; 1.x files hold nothing a later reader reads differently.
READABLE_MAJORS = ("1", "2", "3")

SENDER_ID_DTYPE = np.dtype("S32")

# Every name below is documented in docs/FORMAT.md (a test checks it).
FILE_ATTRS = {
    "format": "always 'rllib_recorder'",
    "schema_version": "'MAJOR.MINOR'; readers refuse an unknown major version",
    "recorder_version": "version of the rllib_recorder package that wrote the file",
    "run_id": "id of the run (also in the manifest)",
    "worker_index": "RLlib env runner index (0: the local runner)",
    "is_evaluation": "True for evaluation env runners",
    "created_at": "ISO-8601 time the file was created",
    "commit": "JSON: committed row counts (see 'Commit record')",
}

BATCH_COLUMNS = {
    "sender_id": "id of the env-runner process incarnation that sent the chunk",
    "seq": "sequence number of the chunk within its sender (0, 1, 2, ...)",
    "env_steps": "env steps in the chunk",
    "agent_steps": "agent steps (rows over all agents) in the chunk",
    "num_samples": "on_sample_end calls coalesced into the chunk",
    "sampled_at_s": "wall time (Unix s) of the chunk's first on_sample_end",
    "written_at_s": "wall time (Unix s) the writer committed the chunk",
    "learner_version": "newest weights_seq_no the learner had finished when the chunk was sampled "
                       "(-1: unknown; see 'Policy lag')",
    "weights_seq_no_min": "oldest behaviour-policy version in the chunk",
    "weights_seq_no_max": "newest behaviour-policy version in the chunk",
    "raw_bytes": "bytes of the chunk's arrays before compression",
    "sender_env_steps_sampled": "env steps the sender had sampled (every on_sample_end, stored or not) up to "
                                "and including this chunk's last sample (schema 2.1; see 'Completeness')",
    "sender_env_steps_not_stored": "env steps the sender had sampled but could not hand over by then "
                                   "(back-pressure drops, a full disk, unconvertible samples) (schema 2.1)",
}

# Sender counters a 2.1 batch row keeps (from the record's sender stats), so that verify finds gaps from the file.
SENDER_COUNTERS = {"sender_env_steps_sampled": "env_steps_sampled",
                   "sender_env_steps_not_stored": "env_steps_not_stored"}

STEP_COLUMNS = {
    "obs": "observation the action was computed from (nested spaces: a group)",
    "actions": "action taken (nested spaces: a group)",
    "rewards": "reward of the step",
    "terminateds": "the episode terminated with this step",
    "truncateds": "the episode was truncated with this step",
    "eps_id": "episode id (bytes)",
    "t": "step index within the agent's episode",
    "weights_seq_no": "behaviour policy version that chose the action (-1: unknown)",
    "agent_index": "old API stack: index of the agent in its env",
    "env_t": "multi-agent episodes (new stack, 2.2): env step of the observation the action was computed from",
    "extra_model_outputs": "group: action_logp, action_dist_inputs, vf_preds, ...",
}

FRAGMENT_COLUMNS = {
    "eps_id": "episode id",
    "num_rows": "steps of the fragment",
    "first_row": "row of the fragment's first step in steps/",
    "t_start": "t of the fragment's first step (> 0: continues an earlier fragment)",
    "terminated": "the episode terminated at the fragment's end",
    "truncated": "the episode was truncated at the fragment's end",
    "return": "sum of the fragment's rewards",
    "module_id": "RLModule (policy) that acted",
    "has_last_obs": "the fragment stores its final observation",
    "env_t_last_obs": "multi-agent episodes (new stack, 2.2): env step of last_obs (-1: none)",
    "last_obs": "observation after the fragment's last step (nested: a group)",
    "infos": "JSON list: the info of every observation of the fragment (3.0: zlib-compressed bytes, attribute "
             "encoding 'zlib_json')",
    "batch": "row in /batches of the chunk that carried the fragment",
    "start_state": "bytes: the env's state at the episode's start (first fragment only; empty: none)",
    "start_state_kind": "how start_state was captured: 'classic_control/1', 'ale/1', or '' (none)",
}

# A float32 image column holding exact uint8 values scaled is stored as uint8 with these
# attributes; the value is ``stored * scale + offset`` (as float32). RLlib's Atari wrappers
# give u8 / 128 - 1; plain normalisation gives u8 / 255.
ENCODING_ATTRS = {
    "encoding": "'affine_uint8': the column stores uint8 codes of float32 values",
    "scale": "float32 value = code * scale + offset",
    "offset": "see scale",
}

# An image column stored as frame deltas (schema 3.0, ``frames.xor_encode``) has these attributes.
DELTA_ATTRS = {
    "delta": "'xor_previous_row': rows are stored as frame deltas",
    "delta_key_rows": "a fragment's every this-many-th row (from its first) is stored as it is",
}


def file_name(worker_index: int, is_evaluation: bool = False, tag: str = "") -> str:
    """The file name of one env runner's data inside a run directory (``tag``: the writer's node, if not the driver's)."""
    return f"{'eval-' if is_evaluation else ''}worker-{worker_index:03d}{'.' + tag if tag else ''}.h5"


def node_tag(node_index: int) -> str:
    """The tag in the names of files written on node ``node_index`` of a run: none on the driver's node (0).

    File names are unique over the whole run, so node-local directories gather into one without clashes,
    and a runner restarted on another node never shares a file with its old writer.
    """
    return f"node{node_index}" if node_index else ""


def file_tag_of(name: str) -> str:
    """The node tag in a file name made by ``file_name`` ('' when it has none)."""
    stem = name[: -len(".h5")] if name.endswith(".h5") else name
    return stem.rpartition(".")[2] if "." in stem else ""


def check_version(found: Any, where: str) -> None:
    """Raises SchemaError unless ``found`` is a schema version this reader understands."""
    from rllib_recorder.version import __version__

    major = str(found).split(".")[0]
    if major not in READABLE_MAJORS:
        raise SchemaError(
            f"{where} has schema version {found}, but rllib_recorder {__version__} reads "
            f"versions {' and '.join(m + '.x' for m in READABLE_MAJORS)}; install a matching rllib_recorder"
        )


FRAME_STACK_ATTR = "frame_stack"

FLOAT_SUFFIX = ".__float32"
