"""A user's Tune experiment as the restore test runs it: ``tune.Tuner`` on PPO with the recorder in one line and a
relative ``output_dir``, started in the current directory; its own ``ray.init`` (a local cluster of 2 CPUs).

``python -m tests.tune_program fit STORAGE`` runs experiment ``restorable`` (one trial, a checkpoint every
iteration, 8 iterations) and prints one JSON line per result; the test interrupts it with Ctrl-C.
``python -m tests.tune_program restore STORAGE`` continues it with ``Tuner.restore``, as Tune's message says.
"""

import json
import os
import sys

import ray
from ray import tune
from ray.rllib.algorithms.ppo import PPO, PPOConfig
from ray.tune.registry import register_env

from rllib_recorder import RecorderCallback
from tests.envs import CountingEnv

ITERATIONS = 8


class PrintResults(tune.Callback):
    def on_trial_result(self, iteration, trials, trial, result, **info):
        print(json.dumps({"iteration": result["training_iteration"], "run_dir": result["recorder"]["run_dir"],
                          "sampled": result["env_runners"]["num_env_steps_sampled_lifetime"],
                          "sampled_this_iteration": int(result["env_runners"]["num_env_steps_sampled"])}), flush=True)


def config() -> PPOConfig:
    return (
        PPOConfig().environment("counting", env_config={"obs_kind": "vector"})
        .env_runners(num_env_runners=1, rollout_fragment_length=50)
        .training(train_batch_size=200, minibatch_size=100, num_epochs=1)
        .callbacks(RecorderCallback.configured(output_dir="rec"))  # relative: to where the program started
    )


def main(mode: str, storage: str) -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    register_env("counting", lambda cfg: CountingEnv(cfg))
    if mode == "fit":
        tuner = tune.Tuner(PPO, param_space=config(), run_config=tune.RunConfig(
            name="restorable", storage_path=storage, stop={"training_iteration": ITERATIONS}, verbose=0,
            callbacks=[PrintResults()], checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1)))
    else:
        tuner = tune.Tuner.restore(os.path.join(storage, "restorable"), trainable=PPO, param_space=config())
    results = tuner.fit()
    print(json.dumps({"errors": [str(e) for e in results.errors],
                      "iterations": [r.metrics.get("training_iteration") for r in results]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
