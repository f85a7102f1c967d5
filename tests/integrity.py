"""The one integrity check every recording test uses: every stored row against the test env's code."""

from __future__ import annotations

import numpy as np

from rllib_recorder.read.run import open_run
from tests.envs import decode, episode_length


def check_run(run_dir: str, kind: str = "vector", multi_agent: bool = False,
              statuses: tuple[str, ...] = ("finished",), *, sampled: int | tuple[int, int] | None,
              evaluation_sampled: int | None = None, not_stored: int = 0, allow_gaps: bool = False) -> dict:
    """Checks every stored episode of a run made with CountingEnv / TwoAgentCountingEnv against the env's code,
    and the stored count against someone else's: RLlib's, or the env's own log.

    ``sampled``: the env steps the training env runners sampled, by RLlib's count (``num_env_steps_sampled_lifetime``
    of the trial or attempt, or the per-iteration counts summed) or the env's log: the stored env steps, counted
    here from the rows (for multi-agent: every env step at which some agent's row was stored), plus ``not_stored``
    (the loss a test made and expects named) must equal it; a (low, high) pair where a fault lets the recorder keep
    more than RLlib counted (a runner killed after its sample() ended, before RLlib got it back). None only where a
    test makes no completeness claim. ``evaluation_sampled``: the same for the evaluation runners' files.
    Also: nothing duplicated, nothing reordered (t counts up from 0 across fragments), rewards exact, every finished
    episode whole, episode numbers per sender contiguous. ``allow_gaps``: episodes may be missing between stored
    ones (a test whose faults make the recorder count lost samples). Returns counts for further checks.
    """
    steps, returns, streams, senders_seen, by_agent = 0, {}, {}, {}, {}
    env_steps: dict[bool, set | int] = {False: set() if multi_agent else 0, True: set() if multi_agent else 0}
    with open_run(run_dir) as run:
        assert run.manifest["status"] in statuses, run.manifest["status"]
        for f in run.files:
            for agent in f.agents:
                # A restarted env runner counts its episodes from 0 again, under a new sender id.
                frags, senders = f.fragments(agent), f.batches().get("sender_id", [])
                sender_of = {e: senders[b] for e, b in zip(frags["eps_id"].tolist()[::-1], frags["batch"][::-1])}
                numbers: dict[bytes, list[int]] = {}
                ids = f.episode_ids(agent)
                sampled_ids = set(ids[:: max(1, len(ids) // 16)])  # also read by id, through the episode index
                seen = []
                for episode in f.iter_episodes(agent):  # streamed: a run of 40k episodes reads in seconds
                    eps_id = episode.eps_id
                    seen.append(eps_id)
                    sender = sender_of[eps_id.encode()]
                    number = _check_episode(episode, kind, multi_agent, allow_gaps)
                    numbers.setdefault(sender, []).append(number)
                    returns[eps_id, agent] = episode.episode_return
                    steps += len(episode)
                    if not f.is_evaluation:
                        by_agent[agent] = by_agent.get(agent, 0) + len(episode)
                    if multi_agent:  # an env step counts once, whichever agents acted at it
                        env_steps[f.is_evaluation].update((f.worker_index, sender, number, int(t))
                                                          for t in decode(episode.obs, kind)[:len(episode), 2])
                    else:
                        env_steps[f.is_evaluation] += len(episode)
                    if eps_id in sampled_ids:
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
    counted = {e: len(v) if isinstance(v, set) else v for e, v in env_steps.items()}
    for evaluation, truth in ((False, sampled), (True, evaluation_sampled)):
        if truth is None:
            continue
        low, high = truth if isinstance(truth, tuple) else (truth, truth)
        what = "evaluation" if evaluation else "training"
        assert low <= counted[evaluation] + (0 if evaluation else not_stored) <= high, (
            f"{what} env steps stored {counted[evaluation]} (+{not_stored} expected lost), sampled {truth}")
    return {"agent_steps": steps, "agent_steps_by_agent": by_agent, "env_steps": counted[False], "evaluation_env_steps": counted[True],
            "returns": returns, "streams": streams, "senders": senders_seen}


def _check_episode(episode, kind: str, multi_agent: bool, allow_gaps: bool = False) -> int:
    """Checks one stored episode value by value; returns its episode number. With ``allow_gaps`` (a run that lost
    samples it counted, e.g. to a full disk) an episode may begin part-way: its first fragments were the lost ones."""
    ids = decode(episode.obs, kind)
    assert ids[0, 0] == episode.worker_index % 256, (ids[0], episode)
    assert (ids[:, 1] == ids[0, 1]).all(), (
        f"{episode} mixes episodes: (worker, episode, t) {ids.tolist()}, t {episode.t.tolist()}")
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
