"""The one integrity check every recording test uses: every stored row against the test env's code."""

from __future__ import annotations

import numpy as np

from rllib_recorder.read.run import open_run
from tests.envs import decode, episode_length


def check_run(run_dir: str, kind: str = "vector", multi_agent: bool = False,
              statuses: tuple[str, ...] = ("finished",), allow_gaps: bool = False) -> dict:
    """Checks every stored episode of a run made with CountingEnv / TwoAgentCountingEnv.

    Nothing lost (episode numbers per runner and agent are contiguous, every finished
    episode has its full length), nothing duplicated, nothing reordered (t counts up
    from 0 across fragments), rewards exact. ``allow_gaps``: episodes may be missing between stored ones (a test
    whose faults make the recorder count lost samples). Returns counts for further checks.
    """
    steps, returns, streams, senders_seen = 0, {}, {}, {}
    with open_run(run_dir) as run:
        assert run.manifest["status"] in statuses, run.manifest["status"]
        for f in run.files:
            for agent in f.agents:
                # A restarted env runner counts its episodes from 0 again, under a new sender id.
                frags, senders = f.fragments(agent), f.batches().get("sender_id", [])
                sender_of = {e: senders[b] for e, b in zip(frags["eps_id"].tolist()[::-1], frags["batch"][::-1])}
                numbers: dict[bytes, list[int]] = {}
                ids = f.episode_ids(agent)
                sampled = set(ids[:: max(1, len(ids) // 16)])  # also read by id, through the episode index
                seen = []
                for episode in f.iter_episodes(agent):  # streamed: a run of 40k episodes reads in seconds
                    eps_id = episode.eps_id
                    seen.append(eps_id)
                    numbers.setdefault(sender_of[eps_id.encode()], []).append(_check_episode(episode, kind, multi_agent, allow_gaps))
                    returns[eps_id, agent] = episode.episode_return
                    steps += len(episode)
                    if eps_id in sampled:
                        by_id = f.episode(eps_id, agent)
                        for name in ("obs", "actions", "rewards", "t", "terminateds", "truncateds"):
                            np.testing.assert_array_equal(getattr(by_id, name), getattr(episode, name))
                assert seen == ids, f"episodes out of order or missing in {f.path}:{agent}"
                for sender, found in numbers.items():
                    assert len(found) == len(set(found)), f"duplicate episodes in {f.path}:{agent}"
                    assert allow_gaps or sorted(found) == list(range(min(found), max(found) + 1)), (
                        f"lost episodes in {f.path}:{agent}: {sorted(found)}")
                streams[f.worker_index, f.is_evaluation, agent] = [n for found in numbers.values() for n in found]
                senders_seen[f.worker_index, f.is_evaluation] = len(numbers)
    return {"agent_steps": steps, "returns": returns, "streams": streams, "senders": senders_seen}


def _check_episode(episode, kind: str, multi_agent: bool, allow_gaps: bool = False) -> int:
    """Checks one stored episode value by value; returns its episode number. With ``allow_gaps`` (a run that lost
    samples it counted, e.g. to a full disk) an episode may begin part-way: its first fragments were the lost ones."""
    ids = decode(episode.obs, kind)
    assert ids[0, 0] == episode.worker_index % 256, (ids[0], episode)
    assert (ids[:, 1] == ids[0, 1]).all(), f"{episode} mixes episodes"
    t0 = int(episode.t[0]) if allow_gaps and len(episode) else 0
    np.testing.assert_array_equal(ids[:, 2], (t0 + np.arange(len(ids))) % 256)
    np.testing.assert_array_equal(episode.t, t0 + np.arange(len(episode)))
    np.testing.assert_array_equal(episode.rewards, t0 + np.arange(1, len(episode) + 1))
    assert (episode.weights_seq_no >= 0).all() or (episode.weights_seq_no == -1).all()
    agent_a = episode.agent_id in ("a", "pa")  # new stack: agent ids; old stack: policy ids
    if multi_agent:
        assert (episode.obs[:, 3] == (0 if agent_a else 1)).all()
    if episode.terminateds.any():
        expected = episode_length(int(ids[0, 1])) + (2 if multi_agent and agent_a else 0) - t0
        assert len(episode) == expected, (episode, expected)
        assert episode.terminateds[-1] and not episode.terminateds[:-1].any()
        assert len(ids) == len(episode) + 1  # the final observation is kept
    return int(ids[0, 1])
