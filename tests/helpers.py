"""Test helpers shared by every test: hand-built episodes and batches, and one integrity check."""

from __future__ import annotations

import contextlib

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


@contextlib.contextmanager
def own_cluster_env():
    """The environment of a child that starts a ``ray.cluster_utils.Cluster``: a Ray temp dir of its own (short, for
    Ray's socket paths), removed afterwards. A Cluster writes its address to ``<temp dir>/ray/ray_current_cluster``,
    where every plain ``ray.init()`` on the machine would join it, a user program of another test meanwhile too."""
    import os
    import shutil
    import tempfile

    tmp_dir = tempfile.mkdtemp(prefix="rc-", dir="/tmp")
    try:
        yield dict(os.environ, RAY_TMPDIR=tmp_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


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


def with_callbacks(config, classes: list):
    """``config.callbacks(classes)``: as a list where RLlib takes one (the new API stack, Ray 2.44 and later), else
    composed by ``make_multi_callbacks`` (the old API stack; every stack before Ray 2.44)."""
    from ray.rllib.algorithms.callbacks import make_multi_callbacks

    from rllib_recorder._rllib_compat import ray_release

    if config.enable_env_runner_and_connector_v2 and ray_release() >= (2, 44):
        return config.callbacks(list(classes))
    return config.callbacks(make_multi_callbacks(list(classes)))


def rllib_sampled(results: list[dict], key: str = "num_env_steps_sampled", before: int = 0) -> int | dict:
    """RLlib's own count of what the training env runners sampled over ``results``, every train result of one
    Algorithm in order (``before``: its lifetime count when it began, a restored checkpoint's). ``key``:
    "num_env_steps_sampled", or "num_agent_steps_sampled" for a dict per agent (new API stack).

    The iterations' own counts summed; where RLlib's lifetime count is right it must say the same, which is
    checked here. Ray 2.50-2.52 over-count a new Algorithm's first iteration in the lifetime count (see
    ``rllib_recorder._rllib_compat.env_steps_sampled``); there the iterations' counts are RLlib's truth.
    """
    from rllib_recorder._rllib_compat import ray_release

    new_stack = "num_env_steps_sampled_lifetime" in (results[-1].get("env_runners") or {})
    if new_stack:
        per_iteration = [r["env_runners"].get(key, 0) for r in results]
        lifetime = results[-1]["env_runners"][f"{key}_lifetime"]
    else:  # the old API stack: lifetime at the top level, per iteration '..._this_iter' (env steps only)
        lifetime = results[-1][key]
        per_iteration = [r.get(f"{key}_this_iter", lifetime if r is results[-1] else 0) for r in results]
    if isinstance(lifetime, dict):
        total = {a: int(sum(_number(p.get(a)) for p in per_iteration)) for a in lifetime}
        shifted = {a: int(n) - before for a, n in lifetime.items()}
    else:
        total, shifted = int(sum(_number(p) for p in per_iteration)), int(_number(lifetime)) - before
    if not (new_stack and (2, 50) <= ray_release() < (2, 53)):
        assert total == shifted, f"RLlib's iterations sampled {total}, its lifetime count says {shifted}"
    return total


def rllib_counts_callback():
    """A Tune callback that sums RLlib's own per-iteration count of env steps sampled per trial, from every result
    as Tune gets it (``.sampled[trial_id]``): every iteration of every attempt, whatever Tune keeps in its files
    after a pause, a restore or PBT's exploit."""
    from ray import tune

    class RllibCounts(tune.Callback):
        def __init__(self) -> None:
            self.sampled: dict[str, int] = {}

        def on_trial_result(self, iteration, trials, trial, result, **info):
            count = (result.get("env_runners") or {}).get("num_env_steps_sampled")
            self.sampled[trial.trial_id] = self.sampled.get(trial.trial_id, 0) + int(_number(count))

    return RllibCounts()


def _number(value) -> float:
    """A count from a result: 0 where RLlib reported none yet (missing, or NaN before the first sample)."""
    return 0.0 if value is None or value != value else float(value)
