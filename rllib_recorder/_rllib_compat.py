"""Every private RLlib, Ray and Tune attribute the recorder reads, and every method of theirs it wraps, in one place.

Each function names the public API it stands in for, or says that Ray 2.60 has none. ``problems()`` lists what the
installed Ray no longer has, so a Ray upgrade that moves one fails ``tests/test_rllib_compat.py`` with a message
naming it, instead of a run quietly losing its stop hook, its policy lag or its consumed rate. Heavy modules are
imported inside the functions: the CLI imports this module without Ray.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
from typing import Any, Callable, Iterator

# The range of Ray releases the recorder is tested with (pyproject.toml declares the same): the whole suite runs on
# the newest, the compatibility job on 2.41.0, 2.50.1 and 2.54.1 (.ci/compat). Each difference between releases
# that the released wheels' sources or those runs showed is handled where it is read, naming the release.
OLDEST_TESTED, NEWEST_TESTED = "2.41.0", "2.60.0"
TESTED_RANGE = ">=2.41,<2.61"
ANY_RAY_ENV = "RLLIB_RECORDER_ANY_RAY"  # set (to anything but 0): no warning outside the tested range
_warned = False


def callback_base() -> type:
    """RLlib's callback base class, ``RLlibCallback`` (Ray 2.41; before: ``DefaultCallbacks``, which the recorder
    does not support: ``unsupported_ray()`` says so when the callback is configured or the algorithm built)."""
    try:
        from ray.rllib.callbacks.callbacks import RLlibCallback
    except ImportError:
        from ray.rllib.algorithms.callbacks import DefaultCallbacks as RLlibCallback
    return RLlibCallback


def unsupported_ray() -> str | None:
    """One line when the installed Ray lacks what recording needs (a release before 2.41), else None."""
    import ray

    if ray_release() >= (2, 41):
        return None
    return (f"ray {ray.__version__} is older than any Ray rllib_recorder can record with (RLlib's callbacks and "
            f"episodes changed in 2.41): install a tested release, pip install 'ray[rllib]{TESTED_RANGE}'")


def warn_untested_ray(echo: Callable[[str], None] | None = None) -> None:
    """Prints once per process, when the installed Ray is outside the tested range, one warning line naming the
    range and ``ANY_RAY_ENV``; recording goes on."""
    global _warned
    import ray

    newest = tuple(int(x) for x in NEWEST_TESTED.split(".")[:2])
    if _warned or ray_release() <= newest or os.environ.get(ANY_RAY_ENV, "0") not in ("", "0"):
        return
    _warned = True
    line = (f"rllib_recorder: warning: ray {ray.__version__} is newer than the releases it was tested with "
            f"({OLDEST_TESTED} to {NEWEST_TESTED}); recording goes on, and rllib-recorder verify checks each run "
            f"(set {ANY_RAY_ENV}=1 to silence this)")
    (echo or (lambda text: print(text, file=sys.stderr)))(line)


def ray_data_pandas_problem() -> str | None:
    """One line when Ray Data can't hand RLlib tensor columns under the installed pandas, else None.

    Ray 2.54 and earlier cast tensor columns to numpy through ``pandas.errors.SettingWithCopyWarning``, which
    pandas 3 removed (Ray 2.55 stopped using it): RLlib's offline reads of a run then fail inside Ray Data's workers.
    """
    if ray_release() >= (2, 55):
        return None
    try:
        import pandas
    except ImportError:
        return None
    if hasattr(pandas.errors, "SettingWithCopyWarning"):
        return None
    import ray

    return (f"ray {ray.__version__}'s Ray Data needs pandas' SettingWithCopyWarning, which pandas {pandas.__version__} "
            "no longer has (Ray 2.55 stopped using it): pip install 'pandas<3', or a Ray from 2.55")


def tune_dir_names(algorithm: Any) -> tuple[str | None, str | None]:
    """(experiment dir name, trial dir name) of the Tune trial running ``algorithm``; (None, None) outside Tune.

    Private: ``Trainable._storage`` (Tune's ``StorageContext``), set before ``setup()``. Public:
    ``ray.tune.get_context()`` serves function trainables, and the trial name an Algorithm sees in
    ``on_algorithm_init`` is still "default"; none gives the trial dir name to a class trainable that early.
    """
    storage = getattr(algorithm, "_storage", None)
    trial = getattr(storage, "trial_dir_name", None)
    if not trial:
        return None, None
    return getattr(storage, "experiment_dir_name", None), str(trial)


def learner_weights_seq_no(learner: Any) -> int | None:
    """The learner's ``weights_seq_no``: how many updates it has run.

    Private: ``Learner._weights_seq_no``. Public: the train result's ``learners/<module>/weights_seq_no``, which
    the driver sees once per iteration only (too late for APPO's lag).
    """
    version = getattr(learner, "_weights_seq_no", None)
    return None if version is None else int(version)


def learner_group_dropped_steps(learner_group: Any) -> float:
    """Env steps of updates RLlib dropped because its asynchronous learners were busy.

    Private: ``LearnerGroup._ts_dropped``. Public: none in 2.60.
    """
    return float(getattr(learner_group, "_ts_dropped", 0) or 0)


def tune_registered(category: str, name: str) -> Any | None:
    """What Tune's registry holds under ``name`` in ``category`` ("env_creator", "trainable_class"), or None.

    Private: ``ray.tune.registry._global_registry`` (``contains``/``get``). Public: ``get_trainable_cls`` raises
    for an unknown name and there is no public lookup of env creators; RLlib uses the private registry itself.
    """
    from ray.tune.registry import _global_registry

    if not _global_registry.contains(category, name):
        return None
    return _global_registry.get(category, name)


def tune_registered_names(category: str) -> list[str]:
    """Names registered in ``category`` in this process and not yet flushed to a Ray cluster (did-you-mean hints).

    Private: ``_global_registry._to_flush``. Public: none.
    """
    from ray.tune.registry import _global_registry

    return [key for kind, key in getattr(_global_registry, "_to_flush", {}) if kind == category]


def deprecated_value() -> Any:
    """The value RLlib's config classes give settings that are deprecated (they are not settings to check).

    Private: ``ray._common.deprecation.DEPRECATED_VALUE``. Public: none.
    """
    try:
        from ray._common.deprecation import DEPRECATED_VALUE
    except ImportError:  # Ray 2.49 and earlier: RLlib's own module (2.50 moved it to ray._common)
        from ray.rllib.utils.deprecation import DEPRECATED_VALUE
    return DEPRECATED_VALUE


def translate_config_key(config_class: type, key: str) -> str:
    """RLlib's current name for a config key (``num_workers`` -> ``num_env_runners``); raises for a removed one.

    Private: ``AlgorithmConfig._translate_special_keys``. Public: ``update_from_dict`` does the same, but sets the
    value and does not say which key it took.
    """
    return config_class._translate_special_keys(key, warn_deprecated=True)


def generator_backpressure(objects: int) -> dict[str, Any]:
    """Task options that keep at most ``objects`` results of a generator task in flight.

    Private: the ``_generator_backpressure_num_objects`` option of ``.options()``. Public: none in 2.60.
    """
    return {"_generator_backpressure_num_objects": objects}


def env_steps_sampled(result: dict[str, Any], evaluation: bool = False) -> tuple[int | None, int | None]:
    """RLlib's own count of env steps its env runners sampled, from a train result: (lifetime, this iteration).

    New API stack: ``env_runners/num_env_steps_sampled_lifetime`` and ``env_runners/num_env_steps_sampled``
    (``evaluation/env_runners/...`` for the evaluation runners); old API stack: ``num_env_steps_sampled`` and
    ``num_env_steps_sampled_this_iter``. Ray 2.50.0 to 2.52.x over-count the lifetime count of a new Algorithm's
    first iteration when it samples in several rounds: ``Stats`` merges each round's running total whole
    (``_prev_merge_values`` starts empty; 2.53 rewrote ``Stats``). With PPO, 2 env runners and
    ``rollout_fragment_length=64``, 2.50.1 counts 384 where its env runners (and the env's own log) took 256;
    every later iteration adds the right count. ``service.metrics.RllibSampled`` takes the difference out.
    """
    tree = result.get("evaluation") if evaluation else result
    runners = tree.get("env_runners") if isinstance(tree, dict) else None
    if isinstance(runners, dict) and "num_env_steps_sampled_lifetime" in runners:
        return _count(runners.get("num_env_steps_sampled_lifetime")), _count(runners.get("num_env_steps_sampled"))
    if evaluation or not isinstance(tree, dict):
        return None, None
    return _count(tree.get("num_env_steps_sampled")), _count(tree.get("num_env_steps_sampled_this_iter"))


def _count(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # missing, or NaN before the first sample
        return None


def read_task(read: Callable[[], Any], *, num_rows: int | None, size_bytes: int, input_files: list[str],
              per_task_row_limit: int | None) -> Any:
    """A Ray Data ``ReadTask`` with its ``BlockMetadata`` (public API; its signature moved).

    Ray 2.50 added ``ReadTask(per_task_row_limit=)`` and made ``BlockMetadata``'s ``schema`` optional; before,
    ``schema`` is a required field and ``ReadTask`` takes only the function and the metadata.
    """
    import inspect

    from ray.data.block import BlockMetadata
    from ray.data.datasource import ReadTask

    fields = {"num_rows": num_rows, "size_bytes": size_bytes, "input_files": input_files, "exec_stats": None}
    if "per_task_row_limit" in inspect.signature(ReadTask.__init__).parameters:
        return ReadTask(read, BlockMetadata(**fields), per_task_row_limit=per_task_row_limit)
    return ReadTask(read, BlockMetadata(**fields, schema=None))


# Ray before 2.46: per new-stack episode id, what on_episode_start keeps for on_sample_end (episode_custom_data)
_CUSTOM_DATA: "collections.OrderedDict[str, dict[str, Any]]" = collections.OrderedDict()
CUSTOM_DATA_EPISODES = 4096


def episode_custom_data(episode: Any) -> dict[str, Any]:
    """``episode.custom_data``: a dict that goes with a single-agent new-stack episode from ``on_episode_start``
    to ``on_sample_end`` in its env runner (public API since Ray 2.46).

    Before 2.46 ``SingleAgentEpisode`` has ``__slots__`` and no such dict: one per episode id is kept here, for
    the newest ``CUSTOM_DATA_EPISODES`` episodes (older ones: episodes RLlib dropped unreturned). ``{}`` (not
    kept) for an object without an id.
    """
    data = getattr(episode, "custom_data", None)
    if data is not None:
        return data
    key = getattr(episode, "id_", None)
    if key is None:
        return {}
    data = _CUSTOM_DATA.get(key)
    if data is None:
        data = _CUSTOM_DATA[key] = {}
        if len(_CUSTOM_DATA) > CUSTOM_DATA_EPISODES:
            _CUSTOM_DATA.popitem(last=False)
    return data


def forget_custom_data(episode: Any, key: str) -> None:
    """Drops ``key`` from the episode's ``episode_custom_data`` (before Ray 2.46: the episode's whole entry)."""
    data = getattr(episode, "custom_data", None)
    if data is not None:
        data.pop(key, None)
    else:
        _CUSTOM_DATA.pop(getattr(episode, "id_", None), None)


def wrap_method(owner: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replaces ``owner.name`` (an instance attribute, or a module function) by ``wrapper(original)``."""
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(wrapper(original)))


def on_algorithm_cleanup(algorithm: Any, before: Callable[[], None]) -> None:
    """Runs ``before()`` when the algorithm stops, before its env runners are stopped.

    Wraps ``Algorithm.cleanup``, which ``Trainable.stop()`` calls (``algo.stop()``, and Tune at the end of a
    trial). Public: RLlib 2.60 has no callback for an algorithm's stop.
    """
    def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def cleanup(*args: Any, **kwargs: Any) -> Any:
            try:
                before()
            finally:  # RLlib's own cleanup runs whatever happened before
                result = original(*args, **kwargs)
            return result
        return cleanup

    wrap_method(algorithm, "cleanup", wrapper)


def after_learner_update(learner: Any, after: Callable[[], None]) -> Callable[..., Any]:
    """Runs ``after()`` at the end of every update of ``learner``, in its process; returns the original method.

    Wraps ``Learner.after_gradient_based_update``, which ``Learner.update`` calls through the instance once its
    gradient steps are done. Public: none that runs in the learner's process after an update.
    """
    original = getattr(learner, "_rllib_recorder_original_after_update", learner.after_gradient_based_update)

    def after_gradient_based_update(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        after()
        return result

    learner._rllib_recorder_original_after_update = original
    learner.after_gradient_based_update = after_gradient_based_update
    return original


def before_learner_group_update(learner_group: Any, before: Callable[[dict[str, Any]], None]) -> None:
    """Calls ``before(kwargs)`` with the keyword arguments of every update the algorithm asks of ``learner_group``.

    Wraps the instance's ``LearnerGroup.update``, which every algorithm's ``training_step`` calls with keywords
    since Ray 2.44; before, the algorithms call ``update_from_batch(batch=...)``, ``update_from_episodes(
    episodes=...)`` or (the offline ones) ``_update(batch=...)``, and the first two call ``_update``: that one is
    wrapped there. Remote learners can't be wrapped: Ray calls their ``update`` by name on the class. Private
    before 2.44 (``LearnerGroup._update``); public: none.
    """
    def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def update(*args: Any, **kwargs: Any) -> Any:
            before(kwargs)
            return original(*args, **kwargs)
        return update

    for name in _learner_group_update_names():
        wrap_method(learner_group, name, wrapper)


def _learner_group_update_names() -> tuple[str, ...]:
    return ("update",) if ray_release() >= (2, 44) else ("_update",)


def ray_release() -> tuple[int, int]:
    """(major, minor) of the installed Ray: the releases named above are told apart by it."""
    import ray

    major, minor = (ray.__version__.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@contextlib.contextmanager
def ray_data_read_method(name: str, read: Callable[..., Any]) -> Iterator[None]:
    """``ray.data.<name>`` is ``read`` while the block runs, so that RLlib's ``OfflineData`` finds it.

    Stands in for a callable ``input_read_method``: ``AlgorithmConfig.offline_data`` types it as a string or a
    callable, but ``OfflineData.__init__`` in 2.60 looks it up by name on ``ray.data``.
    """
    import ray.data

    had = hasattr(ray.data, name)
    previous = getattr(ray.data, name, None)
    setattr(ray.data, name, read)
    try:
        yield
    finally:
        if had:
            setattr(ray.data, name, previous)
        else:
            delattr(ray.data, name)


def close_ray_data_iterators() -> int:
    """Closes every live Ray Data batch iterator of this process (while Ray is up); returns how many.

    Ray 2.60's ``DataIterator._iter_batches`` generator reports metrics to a Ray actor when it is closed; closed by
    the garbage collector after ``ray.shutdown()`` (at interpreter exit: RLlib's learner still holds it after
    ``algo.stop()``), it logs a traceback. Public: none closes them.
    """
    import gc
    import types

    name = "DataIterator._iter_batches.<locals>._create_iterator"
    closed = 0
    for obj in gc.get_objects():
        if type(obj) is types.GeneratorType and obj.gi_code.co_qualname == name:  # type(): no attribute lookups
            obj.close()
            closed += 1
    return closed


def ray_job_dead(gcs_address: str, job_id: str, timeout_s: float = 2.0) -> bool | None:
    """Whether Ray job ``job_id`` (hex) of the cluster whose GCS is at ``gcs_address`` has ended; None when that
    GCS does not answer within about ``timeout_s`` or does not know the job.

    Stands in for ``ray.util.state.list_jobs`` and ``JobSubmissionClient``, which need the dashboard (a driver
    started with ``include_dashboard=False`` has none), through ``ray._raylet.GcsClient``. Its constructor waits
    40 s for a GCS that is not there, so the port is tried first.
    """
    import socket

    host, _, port = gcs_address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        from ray._raylet import GcsClient

        jobs = GcsClient(address=gcs_address).get_all_job_info(
            job_or_submission_id=job_id, skip_submission_job_info_field=True, skip_is_running_tasks_field=True,
            timeout=timeout_s)
    except Exception:  # noqa: BLE001 - unreachable, refused, or not a GCS: nothing is known
        return None
    states = [bool(info.is_dead) for key, info in jobs.items() if key.hex() == job_id]
    return states[0] if states else None


def problems() -> list[str]:
    """What the installed Ray lacks of the above, each in one line naming the access and where to fix it."""
    import ray
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
    from ray.rllib.core.learner.learner import Learner
    from ray.rllib.core.learner.learner_group import LearnerGroup
    from ray.tune.registry import ENV_CREATOR, TRAINABLE_CLASS

    found = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            found.append(f"ray {ray.__version__} (tested: {OLDEST_TESTED} to {NEWEST_TESTED}): {what}; "
                         "update rllib_recorder/_rllib_compat.py")

    import inspect

    need("self._storage" in inspect.getsource(__import__("ray.tune.trainable.trainable", fromlist=["x"]).Trainable),
         "Trainable no longer keeps its StorageContext in _storage (tune_dir_names)")
    need("self._weights_seq_no" in inspect.getsource(Learner), "Learner has no _weights_seq_no (learner_weights_seq_no)")
    need(callable(getattr(Learner, "after_gradient_based_update", None)),
         "Learner has no after_gradient_based_update (after_learner_update)")
    updating = Learner.update if ray_release() >= (2, 44) else Learner._update_from_batch_or_episodes
    need("self.after_gradient_based_update(" in inspect.getsource(updating),
         f"Learner.{updating.__name__} no longer calls self.after_gradient_based_update (after_learner_update)")
    need("self._ts_dropped" in inspect.getsource(LearnerGroup),
         "LearnerGroup has no _ts_dropped (learner_group_dropped_steps)")
    need(all(callable(getattr(LearnerGroup, name, None)) for name in _learner_group_update_names()),
         f"LearnerGroup has no {' or '.join(_learner_group_update_names())} (before_learner_group_update)")
    try:
        from ray.tune.registry import _global_registry
        need(all(callable(getattr(_global_registry, m, None)) for m in ("contains", "get")),
             "ray.tune.registry._global_registry has no contains/get (tune_registered)")
        need(isinstance(getattr(_global_registry, "_to_flush", None), dict),
             "ray.tune.registry._global_registry has no _to_flush dict (tune_registered_names)")
    except ImportError:
        need(False, "ray.tune.registry has no _global_registry (tune_registered)")
    need(bool(ENV_CREATOR) and bool(TRAINABLE_CLASS), "ray.tune.registry lost ENV_CREATOR/TRAINABLE_CLASS")
    try:
        deprecated_value()
    except ImportError:
        need(False, "ray._common.deprecation.DEPRECATED_VALUE is gone (deprecated_value)")
    need(callable(getattr(AlgorithmConfig, "_translate_special_keys", None)),
         "AlgorithmConfig has no _translate_special_keys (translate_config_key)")
    from ray.rllib.algorithms.algorithm import Algorithm
    from ray.rllib.offline.offline_data import OfflineData

    need("getattr(ray.data, self.data_read_method)" in inspect.getsource(OfflineData.__init__),
         "OfflineData no longer reads with getattr(ray.data, input_read_method) (ray_data_read_method)")
    need(callable(getattr(Algorithm, "cleanup", None)) and "self.cleanup()" in inspect.getsource(
        __import__("ray.tune.trainable.trainable", fromlist=["x"]).Trainable.stop),
        "Trainable.stop() no longer calls self.cleanup() (on_algorithm_cleanup)")
    try:
        from ray._raylet import GcsClient, InnerGcsClient  # the first hands every call on to the second

        need(callable(GcsClient) and callable(getattr(InnerGcsClient, "get_all_job_info", None)),
             "GcsClient has no get_all_job_info (ray_job_dead)")
    except ImportError:
        need(False, "ray._raylet has no GcsClient (ray_job_dead)")
    return found
