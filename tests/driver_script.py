"""A training driver for the driver-kill test: its own local Ray cluster, records, prints progress per iteration."""

import json
import sys

import ray
from ray.tune.registry import register_env

from rllib_recorder import RecorderCallback
from tests.envs import CountingEnv
from tests.test_recording import ppo

if __name__ == "__main__":
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    register_env("counting", lambda cfg: CountingEnv(cfg))
    config = ppo(runners=1).callbacks(RecorderCallback.configured(output_dir=sys.argv[1], coalesce_rows=0))
    algo = config.build_algo()
    sampled = 0
    while True:  # until killed
        result = algo.train()
        recorder = result["recorder"]
        sampled += int(result["env_runners"]["num_env_steps_sampled"])  # RLlib's own count, iteration by iteration
        print(json.dumps({"run_dir": recorder["run_dir"], "stored": recorder["env_steps_stored"],
                          "rllib_sampled": sampled}), flush=True)
