"""The learner side: each learner reports every weights version it finishes, with its wall time, to the writers.

Why the learner and not the driver: RLlib's ``Learner.update()`` raises ``weights_seq_no`` by one per
update, and the weights of that version exist once the update ends; env runners act with them only
after a later sync. The driver hears of the version only at ``on_train_result``, after the sync and,
for APPO/IMPALA (learner thread, several ``training_step`` calls per iteration), many versions late:
samples taken with freshly synced weights then looked one version "ahead" of the learner. Reported
from the learner at the end of each update, the timeline is exact for PPO (no update runs while
env runners sample) and shows the true distance for asynchronous algorithms.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from rllib_recorder._rllib_compat import (
    after_learner_update,
    before_learner_group_update,
    learner_group_dropped_steps,
    learner_weights_seq_no,
)

logger = logging.getLogger(__name__)

_HOOKED = "_rllib_recorder_run_id"


def learner_version(learner: Any) -> int | None:
    """The learner's ``weights_seq_no``: the number of updates it has run (RLlib keeps it private)."""
    return learner_weights_seq_no(learner)


class VersionReporter:
    """Sends ``set_learner_version(version, at_s)`` to every writer of a run; never raises."""

    def __init__(self, writer_actors: list[Any], clock: Callable[[], float] = time.time) -> None:
        self.writer_actors = writer_actors
        self.clock = clock
        self.last_version: int | None = None
        self.errors = 0

    def report(self, version: int | None) -> None:
        if version is None or version == self.last_version:
            return
        at_s = self.clock()
        try:
            for writer_actor in self.writer_actors:
                writer_actor.set_learner_version.remote(version, at_s)
            self.last_version = version
        except Exception as e:  # a lost report only makes later lags look smaller
            self.errors += 1
            if self.errors == 1:
                logger.warning("rllib_recorder: reporting learner version %s failed: %s", version, e)


def hook_learner(learner: Any, run_id: str, writer_actors: list[Any]) -> int | None:
    """Wraps ``learner.after_gradient_based_update`` to report each finished version (once per run;
    hooking again only hands the reporter the current writers).

    Run on each learner by the driver (``LearnerGroup.foreach_learner``), in the learner's process;
    reports the learner's current version at once. Returns that version.
    """
    if getattr(learner, _HOOKED, None) == run_id:  # hooked already: writers were added on new nodes
        learner._rllib_recorder_reporter.writer_actors = writer_actors
        learner._rllib_recorder_reporter.last_version = None
        learner._rllib_recorder_reporter.report(learner_version(learner))
        return learner_version(learner)
    reporter = VersionReporter(writer_actors)
    after_learner_update(learner, lambda: reporter.report(learner_version(learner)))
    learner._rllib_recorder_reporter = reporter
    setattr(learner, _HOOKED, run_id)
    reporter.report(learner_version(learner))
    return learner_version(learner)


def hook_learners(algorithm: Any, run_id: str, namespace: str, writer_names: list[str]) -> int:
    """Hooks every learner of ``algorithm``; returns how many report (0: none, e.g. the old API stack)."""
    group = getattr(algorithm, "learner_group", None)
    if group is None:
        return 0

    def hook(learner: Any) -> int | None:
        import ray

        actors = []
        for name in writer_names:
            try:
                actors.append(ray.get_actor(name, namespace=namespace))
            except ValueError:  # that writer is gone (its node left the cluster): nothing to tell it
                pass
        return hook_learner(learner, run_id, actors)

    results = group.foreach_learner(hook)
    versions = [r for r in (_value(r) for r in results) if r is not None]
    return len(versions)


def _value(result: Any) -> Any:
    """A plain value from ``foreach_learner`` (a list of values, or RemoteCallResults of CallResults)."""
    if hasattr(result, "ok"):
        return result.get() if result.ok else None
    return result


class ConsumedSteps:
    """Counts the env steps an algorithm hands its learners to train on: each step once per ``update()`` call.

    RLlib's own ``learners/__all_modules__/num_env_steps_trained_lifetime`` adds a minibatch's whole batch
    size for every minibatch of every epoch (PPO: 10,000 sampled steps read as 344,497 trained), so it can't
    be set beside the steps sampled. This wraps ``algorithm.learner_group.update`` (an instance attribute; the
    algorithm calls it on every training step) and counts the data handed in before RLlib's learner connector
    adds its bootstrap steps: episodes by their env steps, batches by ``env_steps()``. Data handed over as
    object references (APPO/IMPALA) is counted as RLlib counts it when it drops such an update: per reference,
    ``rollout_fragment_length * num_envs_per_env_runner`` (or the per-learner train batch for batch references).
    Updates RLlib dropped (asynchronous learners at capacity) are taken off again. A replay-based algorithm
    (DQN, SAC) counts every replayed step each time it is drawn, so its consumed rate may exceed the produced one.
    """

    def __init__(self, learner_group: Any, config: Any, start: int = 0) -> None:
        self.env_steps = start
        self.learner_group = learner_group
        self.config = config
        self._dropped_at_start = learner_group_dropped_steps(learner_group)
        before_learner_group_update(learner_group, self._add)

    @property
    def total(self) -> int:
        """Env steps handed to the learners so far, less those RLlib dropped."""
        dropped = learner_group_dropped_steps(self.learner_group) - self._dropped_at_start
        return max(0, int(self.env_steps - dropped))

    def _add(self, kwargs: dict[str, Any]) -> None:
        self.env_steps += self.count(kwargs)

    def count(self, kwargs: dict[str, Any]) -> int:
        data = kwargs.get("training_data")
        get = (lambda name: getattr(data, name, None)) if data is not None else kwargs.get
        try:
            if get("episodes") is not None:
                return sum(_episode_env_steps(e) for e in get("episodes"))
            if get("batch") is not None:
                return int(get("batch").env_steps())
            if get("batches") is not None:
                return sum(int(b.env_steps()) for b in get("batches"))
            if get("episodes_refs") is not None:
                return len(get("episodes_refs")) * int(self.config.get_rollout_fragment_length()) * int(
                    self.config.num_envs_per_env_runner or 1)
            if get("batch_refs") is not None:
                return len(get("batch_refs")) * int(self.config.train_batch_size_per_learner)
        except Exception as e:  # counting must never stop an update; the rate just reads low
            logger.debug("rllib_recorder: counting the env steps of an update failed: %s", e)
        return 0


def _episode_env_steps(episode: Any) -> int:
    env_steps = getattr(episode, "env_steps", None)
    return int(env_steps()) if callable(env_steps) else len(episode)


def count_consumed(algorithm: Any, start: int = 0) -> ConsumedSteps | None:
    """Counts what ``algorithm``'s learners are given to train on (None without a learner group: old API stack)."""
    group = getattr(algorithm, "learner_group", None)
    if group is None or not callable(getattr(group, "update", None)):
        return None
    return ConsumedSteps(group, algorithm.config, start)
