"""Real RLlib runs on real Ray, recorded and read back row by row."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import ray
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.callbacks.callbacks import RLlibCallback
from ray.rllib.connectors.env_to_module.flatten_observations import FlattenObservations
from ray.tune.registry import register_env

from rllib_recorder import RecorderCallback
from rllib_recorder._rllib_compat import ray_release
from rllib_recorder.read.run import open_run
from tests.envs import CountingEnv, TwoAgentCountingEnv
from tests.helpers import rllib_sampled, with_callbacks
from tests.integrity import check_run

register_env("counting", lambda cfg: CountingEnv(cfg))
register_env("counting_ma", lambda cfg: TwoAgentCountingEnv(cfg))


class EpisodeLog(RLlibCallback):
    """The user's own callback (runs before ours): logs RLlib's own return of every episode that ended, per agent.

    New API stack: the returns of every chunk ``sample()`` returned, summed per episode and agent until its last
    (on every release: ``prev_episode_chunks`` came in Ray 2.46). Old API stack: ``EpisodeV2.total_reward`` and its
    ``agent_rewards`` at ``on_episode_end``.
    """

    path = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sums: dict = {}

    def on_sample_end(self, *, samples=None, **kwargs):
        if not isinstance(samples, list):  # the old stack's SampleBatch: logged at on_episode_end
            return
        for episode in samples:
            agents = episode.agent_episodes if hasattr(episode, "agent_episodes") else {"default_agent": episode}
            sums = self._sums.setdefault(episode.id_, {})
            for agent, chunk in agents.items():
                sums[agent] = sums.get(agent, 0.0) + float(chunk.get_return())
            if episode.is_done:
                self._write(episode.id_, self._sums.pop(episode.id_))

    def on_episode_end(self, *, episode, **kwargs):
        if hasattr(episode, "total_reward"):  # old API stack: EpisodeV2; stored per policy when multi-agent
            returns: dict = {}
            for (_, policy), reward in episode.agent_rewards.items():
                returns[policy] = returns.get(policy, 0.0) + float(reward)
            if set(returns) <= {"default_policy"}:
                returns = {"default_agent": float(episode.total_reward)}
            self._write(str(episode.episode_id), returns)

    def _write(self, eps_id, returns):
        with open(self.path, "a") as f:
            f.write(json.dumps({"id": eps_id, "returns": returns}) + "\n")


def ppo(env="counting", obs_kind="vector", runners=2, old_stack=False, multi_agent=False):
    config = (
        PPOConfig().environment(env, env_config={"obs_kind": obs_kind})
        .env_runners(num_env_runners=runners, rollout_fragment_length=40)
        .training(train_batch_size=80 * max(runners, 1), minibatch_size=40, num_epochs=1)
    )
    if obs_kind == "dict":  # RLlib's default models need flat inputs; the connector flattens episodes too
        config = config.env_runners(env_to_module_connector=lambda env, *_: FlattenObservations())  # 2.41: (env)
    if old_stack:
        config = config.api_stack(enable_rl_module_and_learner=False, enable_env_runner_and_connector_v2=False)
    if multi_agent:
        config = config.multi_agent(policies={"pa", "pb"}, policy_mapping_fn=lambda aid, *a, **k: f"p{aid}")
    return config


def record(config, tmp_path, iterations=2, **settings):
    log = tmp_path / "episodes.jsonl"
    user_callback = type("UserLog", (EpisodeLog,), {"path": str(log)})
    config = with_callbacks(config, [user_callback,
                                     RecorderCallback.configured(output_dir=str(tmp_path / "rec"), **settings)])
    algo = config.build_algo()
    results = [algo.train() for _ in range(iterations)]
    run_dir = results[-1]["recorder"]["run_dir"]
    algo.stop()
    logged = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return run_dir, results, logged


@pytest.fixture(scope="module")
def new_stack_run(ray_session, tmp_path_factory):
    # 80 rows per sample: coalescing (100 rows) holds every other sample across an iteration.
    return record(ppo(), tmp_path_factory.mktemp("new"), iterations=3, coalesce_rows=100)


@pytest.mark.compat
def test_every_step_of_every_runner_is_stored_exactly_once(new_stack_run):
    run_dir, results, _ = new_stack_run
    sampled = rllib_sampled(results)  # RLlib's count
    counts = check_run(run_dir, sampled=sampled)  # every row against the env's code, and the count against RLlib's
    assert {w for w, _, _ in counts["streams"]} == {1, 2}
    with open_run(run_dir) as run:
        assert run.num_env_steps == sampled
        assert run.manifest["totals"]["env_steps_stored"] == sampled
        assert run.manifest["totals"]["unacked_at_stop"] == 0
    assert counts["agent_steps"] == sampled


@pytest.mark.compat
def test_stored_returns_equal_rllibs_episode_returns(new_stack_run):
    run_dir, results, logged = new_stack_run
    stored = check_run(run_dir, sampled=rllib_sampled(results))["returns"]
    assert len(logged) > 10
    for entry in logged:  # every episode RLlib finished is stored, with RLlib's return
        assert stored[entry["id"], "default_agent"] == entry["returns"]["default_agent"]


def test_train_results_carry_recorder_metrics(new_stack_run):
    _, results, _ = new_stack_run
    metrics = results[-1]["recorder"]
    for key in ("env_steps_stored", "raw_bytes", "disk_bytes", "steps_uncommitted", "spool_backlog_bytes", "sampler_wait_s",
                "chunks_dropped", "errors", "policy_lag_mean", "policy_lag_hist", "writer_cpu_s"):
        assert key in metrics, key
    assert 0 < metrics["writer_cpu_s"] < 600  # the writer actor's own process, since it started
    assert metrics["errors"] == 0 and metrics["chunks_dropped"] == 0
    assert results[-1]["recorder"]["env_steps_stored"] > 0
    assert metrics["policy_lag_max"] == 0  # synchronous PPO samples with the learner's weights


@pytest.mark.compat
def test_consumed_counts_each_trained_step_once_not_per_epoch_or_minibatch(new_stack_run):
    run_dir, results, _ = new_stack_run
    for n, result in enumerate(results, 1):  # PPO trains on every step it sampled in the iteration, once
        sampled = rllib_sampled(results[:n])
        assert result["recorder"]["env_steps_consumed"] == result["recorder"]["env_steps_sampled"] == sampled
        assert 0 < result["recorder"]["consumed_steps_per_s"] <= result["recorder"]["produced_steps_per_s"] * 1.0001
    if ray_release() >= (2, 46):  # RLlib's own count adds the whole batch for every minibatch: not to be used
        assert results[-1]["learners"]["__all_modules__"]["num_env_steps_trained_lifetime"] > 1.5 * sampled
    with open_run(run_dir) as run:
        assert run.manifest["totals"]["env_steps_consumed"] == sampled


def test_manifest_describes_the_run(new_stack_run):
    run_dir, _, _ = new_stack_run
    with open_run(run_dir) as run:
        manifest = run.manifest
    assert manifest["status"] == "finished" and manifest["algorithm"] == "PPO"
    assert manifest["versions"]["ray"] == ray.__version__ and manifest["api_stack"] == "new"
    assert sorted(manifest["files"]) == ["worker-001.h5", "worker-002.h5"]
    assert "Box" in manifest["spaces"]["default_policy"]["observation"]
    assert manifest["started_at"] <= manifest["finished_at"]


def test_behaviour_policy_versions_and_extras_are_stored(new_stack_run):
    run_dir, results, _ = new_stack_run
    with open_run(run_dir) as run:
        episode = next(run.episodes())
        assert set(episode.extra_model_outputs) >= {"action_logp", "action_dist_inputs"}
        assert episode.extra_model_outputs["action_dist_inputs"].shape == (len(episode), 2)
        versions = np.concatenate([e.weights_seq_no for e in run.episodes()])
        assert versions.min() >= 0 and versions.max() <= results[-1]["recorder"]["learner_version"]
        assert episode.infos[0] == {"episode": int(episode.obs[0, 1])}
        assert episode.infos[1]["t"] == 1


def test_synchronous_ppo_shows_policy_lag_zero_on_every_step(new_stack_run):
    # 2 env runners, samples coalesced over iterations: each stored step acted with the learner's newest weights.
    run_dir, results, _ = new_stack_run
    assert results[-1]["recorder"]["learners_reporting"] == 1
    assert set(results[-1]["recorder"]["policy_lag_hist"]) == {"0"}
    with open_run(run_dir) as run:
        steps = 0
        for f in run.files:
            batches = f.batches()
            assert (batches["learner_version"] == batches["weights_seq_no_min"]).all()
            assert (batches["weights_seq_no_min"] == batches["weights_seq_no_max"]).all()
            versions = f.column("default_agent", "weights_seq_no", slice(0, f.num_rows("default_agent")))
            assert sorted(set(versions.tolist())) == [0, 1, 2]  # three iterations, three versions
            lags = f.policy_lag("default_agent")
            assert lags.tolist() == [0] * f.num_rows("default_agent")
            steps += len(lags)
        assert steps == run.num_env_steps == run.manifest["totals"]["policy_lag_hist"]["0"]
        assert all((e.policy_lag == 0).all() and len(e.policy_lag) == len(e) for e in run.episodes())
        frame = run.to_dataframe()
        assert len(frame) == steps and (frame["policy_lag"] == 0).all()


@pytest.mark.parametrize(
    "obs_kind, old_stack, multi_agent",
    [pytest.param("vector", False, True, marks=pytest.mark.compat),
     pytest.param("vector", True, False, marks=pytest.mark.compat),
     pytest.param("vector", True, True, marks=pytest.mark.compat), ("image", False, False),
     ("image_u8", True, False), ("dict", False, False)],
    ids=["new-multi-agent", "old-single-agent", "old-multi-agent", "image-obs", "uint8-image-obs-old-stack",
         "dict-obs"],
)
def test_recorded_runs_read_back_exactly(ray_session, tmp_path, obs_kind, old_stack, multi_agent):
    env = "counting_ma" if multi_agent else "counting"
    # the other spaces on one env runner (two runners' files: the vector cases and every_step_... above)
    run_dir, results, logged = record(
        ppo(env, obs_kind, runners=2 if obs_kind == "vector" else 1, old_stack=old_stack, multi_agent=multi_agent),
        tmp_path, iterations=2
    )
    counts = check_run(run_dir, obs_kind, multi_agent=multi_agent, sampled=rllib_sampled(results))
    if multi_agent and not old_stack:  # RLlib's count per agent too
        assert counts["agent_steps_by_agent"] == rllib_sampled(results, "num_agent_steps_sampled")
    elif multi_agent:  # the old stack counts agent steps, not per agent
        assert counts["agent_steps"] == rllib_sampled(results, "num_agent_steps_sampled")
    assert results[-1]["recorder"]["errors"] == 0
    # consumed: each sampled step trained on once, on both API stacks (the old one counts train batches itself)
    assert results[-1]["recorder"]["env_steps_consumed"] == results[-1]["recorder"]["env_steps_sampled"] > 0
    assert len(logged) > 5  # RLlib's own return of every episode that ended, per agent, against the stored one
    for entry in logged:
        for agent, value in entry["returns"].items():
            assert counts["returns"][entry["id"], agent] == value, (entry, agent)
    with open_run(run_dir) as run:
        agents = {a for f in run.files for a in f.agents}
        assert agents == ({"pa", "pb"} if old_stack and multi_agent else {"a", "b"} if multi_agent else {"default_agent"})
        assert run.manifest["api_stack"] == ("old" if old_stack else "new")
    assert counts["agent_steps"] > 0


@pytest.mark.parametrize("record_evaluation", [True, False])
def test_evaluation_runners_get_their_own_marked_files(ray_session, tmp_path, record_evaluation):
    config = ppo(runners=1).evaluation(
        evaluation_interval=1, evaluation_num_env_runners=1, evaluation_duration=3,
        evaluation_duration_unit="episodes",
    )
    run_dir, results, _ = record(config, tmp_path, iterations=1, record_evaluation=record_evaluation)
    evaluated = results[-1]["evaluation"]["env_runners"]["num_env_steps_sampled_lifetime"]  # RLlib's count
    counts = check_run(run_dir, sampled=rllib_sampled(results),
                       evaluation_sampled=int(evaluated) if record_evaluation else 0)
    eval_streams = [key for key in counts["streams"] if key[1]]
    with open_run(run_dir) as run:
        files = sorted(os.path.basename(f.path) for f in run.files)
        if not record_evaluation:
            assert files == ["worker-001.h5"] and not eval_streams
            return
        assert files == ["eval-worker-001.h5", "worker-001.h5"]
        evaluation = run.worker(1, is_evaluation=True)
        assert evaluation.is_evaluation and not run.worker(1).is_evaluation
        finished = [e for e in evaluation.episode_ids() if evaluation.episode(e, "default_agent").is_done]
        assert len(finished) >= 3  # evaluation_duration=3 episodes, each stored whole
        training_only = sum(len(f.episode(e, a)) for f in run.files if not f.is_evaluation
                            for a in f.agents for e in f.episode_ids(a))
    assert training_only == rllib_sampled(results)
