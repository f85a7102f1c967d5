"""A user's training script as the real-use fault tests run it: plain RLlib with the recorder in one line, no
``ray.init`` of its own and, like most RLlib examples and notebooks, no ``algo.stop()``.

``python -m tests.user_program MODE OUTPUT_DIR [STAGING_DIR]``; prints one JSON line per iteration (run dir and RLlib's sampled
count: its iterations' own counts summed, 400 an iteration). MODE: ``end`` (3 iterations, then the script ends), ``long`` (12, then it ends), ``raise`` (an exception after 2), ``shutdown``
(``ray.shutdown()`` after 2, then the script ends), ``loop`` (trains until a signal ends it).
"""

import json
import sys

from ray.rllib.algorithms.ppo import PPOConfig
from ray.tune.registry import register_env

from rllib_recorder import RecorderCallback
from tests.envs import CountingEnv


def main(mode: str, output_dir: str, staging_dir: str | None = None) -> None:
    register_env("counting", lambda cfg: CountingEnv(cfg))  # its observations let the test check every row
    config = (
        PPOConfig().environment("counting", env_config={"obs_kind": "vector"})
        .env_runners(num_env_runners=2, rollout_fragment_length=50)
        .training(train_batch_size=400, minibatch_size=100, num_epochs=1)
        .callbacks(RecorderCallback.configured(output_dir=output_dir, num_writers=2,
                                               **({"staging_dir": staging_dir} if staging_dir else {})))
    )
    algo = config.build_algo()
    iterations = {"end": 3, "long": 12, "raise": 2, "shutdown": 2}.get(mode, 10**9)
    sampled = 0
    for _ in range(iterations):
        result = algo.train()
        sampled += int(result["env_runners"]["num_env_steps_sampled"])  # RLlib's own count, iteration by iteration
        print(json.dumps({"run_dir": result["recorder"]["run_dir"], "sampled": sampled}), flush=True)
    if mode == "raise":
        raise RuntimeError("a bug in the user's loop")
    if mode == "shutdown":
        import ray

        ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
