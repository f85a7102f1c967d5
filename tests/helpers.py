"""Test helpers shared by every test: hand-built episodes and batches, and one integrity check."""

from __future__ import annotations

import numpy as np


def make_episode(n: int, *, t_started: int = 0, obs_offset: float = 0.0, terminated: bool = False,
                 eps_id: str | None = None, version: int = 3, with_last: bool = True):
    """A numpy SingleAgentEpisode fragment whose obs[t] == [obs_offset + t, -t]."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    obs = [np.array([obs_offset + t, -t], np.float32) for t in range(t_started, t_started + n + int(with_last))]
    episode = SingleAgentEpisode(
        id_=eps_id, observations=obs, actions=[t % 2 for t in range(n)],
        rewards=[float(t) for t in range(t_started, t_started + n)],
        infos=[{"t": t} for t in range(t_started, t_started + len(obs))],
        extra_model_outputs={"action_logp": [-0.5] * n, "weights_seq_no": [version] * n},
        terminated=terminated, len_lookback_buffer=0, t_started=t_started,
    )
    episode.to_numpy()
    return episode


SINK: list = []


def image_episode(codes, eps_id, t_started=0, scale=128.0, offset=-1.0):
    """A fragment whose (n+1) image observations are ``codes / scale + offset`` (float32), like RLlib's Atari frames."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    obs = [np.float32(c) / np.float32(scale) + np.float32(offset) for c in codes]
    n = len(obs) - 1
    episode = SingleAgentEpisode(
        id_=eps_id, observations=obs, actions=[0] * n, rewards=[0.0] * n, infos=[{}] * (n + 1),
        extra_model_outputs={"weights_seq_no": [0] * n}, len_lookback_buffer=0, t_started=t_started,
    )
    episode.to_numpy()
    return episode, np.stack(obs)


def stacked_frames(rng, n: int, k: int = 4, size: int = 6, first: np.ndarray | None = None) -> np.ndarray:
    """The uint8 codes of n+1 observations that stack the k latest frames on the last axis, like RLlib's Atari
    FrameStack: a reset fills the stack with its first frame; ``first`` (a stack) continues an episode instead."""
    frames = list(np.moveaxis(first, -1, 0)) if first is not None else [rng.integers(0, 256, (size, size))] * k
    frames += list(rng.integers(0, 256, (n, size, size)))
    return np.stack([np.stack(frames[t:t + k], axis=-1) for t in range(n + 1)])


def collect(item) -> None:
    """A `replay --to tests.helpers:collect` target: keeps what it is given."""
    SINK.append(item)


def update_index_many(args) -> None:
    """A process of the concurrent-index test: updates its run's entry many times (imports little: spawned)."""
    import os

    from rllib_recorder.format.index import update_run

    experiment_dir, name, times = args
    for i in range(times):
        update_run(experiment_dir, os.path.join(experiment_dir, name), {"status": "running", "env_steps": i})
    update_run(experiment_dir, os.path.join(experiment_dir, name), {"status": "finished", "env_steps": times})


def damage(data: bytes, kind: str, at: int, size: int, rng) -> bytes:
    """``data`` damaged at byte ``at``: ``flip`` bits of ``size`` bytes, ``truncate`` there, ``zero`` size * 64
    bytes, or ``random`` bytes of that length instead (the mutations of the damaged-file test and fuzz script)."""
    out = bytearray(data)
    if kind == "flip":
        for i in range(at, min(len(out), at + size)):
            out[i] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        out = out[:at]
    elif kind == "zero":
        out[at:at + size * 64] = bytes(len(out[at:at + size * 64]))
    else:
        out = bytearray(rng.randbytes(max(1, at)))
    return bytes(out)


def communicate_or_kill(proc, timeout: float, what: str) -> tuple[str, str]:
    """(stdout, stderr) of a child started with ``start_new_session=True``; kills its process group and fails the
    test when it has not ended within ``timeout`` seconds."""
    import os
    import signal
    import subprocess

    import pytest

    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what} did not end within {timeout} s: {(err or '')[-3000:]}")


def plain_rows(dataset, frags=None) -> "np.ndarray":
    """Every row of a column read with plain h5py as docs/FORMAT.md says: frame deltas (schema 3.0) undone
    fragment by fragment (``frags``: the agent's fragments group; found beside the column by default)."""
    import numpy as np

    rows = dataset[()]
    if dataset.attrs.get("delta") == "xor_previous_row":
        frags = frags if frags is not None else dataset.file[dataset.name.partition("/steps/")[0] + "/fragments"]
        every = int(dataset.attrs["delta_key_rows"])
        for first, n in zip(frags["first_row"][()], frags["num_rows"][()]):
            for a in range(int(first), int(first + n), every):
                b = min(a + every, int(first + n))
                np.bitwise_xor.accumulate(rows[a:b], axis=0, out=rows[a:b])
    return rows
