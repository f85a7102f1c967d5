"""`rllib-recorder train`: an experiment's RLlib config with the recorder attached, run with Tune, quietly."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any, Callable, Iterator

from rllib_recorder.commands.experiment import ExperimentSpec
from rllib_recorder.commands.experiment_check import check_experiment
from rllib_recorder.errors import ConfigError


def build_config(spec: ExperimentSpec) -> Any:
    """The AlgorithmConfig of an experiment (checked by ``check_experiment``), with the recorder callback added."""
    from rllib_recorder.callback import RecorderCallback

    config = check_experiment(spec)
    callback = RecorderCallback.configured(spec.recorder)  # creates the output dir: only once all is checked
    callbacks = config.callbacks_class
    existing = [c for c in (callbacks if isinstance(callbacks, list) else [callbacks])
                if c.__name__ not in ("RLlibCallback", "DefaultCallbacks")]
    return config.callbacks(existing + [callback] if existing else callback)


def describe(spec: ExperimentSpec) -> str:
    """One line: what the experiment trains, until when, and where it records."""
    stop = ", ".join(f"{k} {v}" for k, v in spec.stop.items()) or "Tune stops it"
    into = os.path.join(spec.recorder.output_dir, spec.recorder.run_name or spec.name)
    relative = os.path.relpath(into)
    return (f"training {spec.run} on {spec.env} until {stop}; recording into "
            f"{into if relative.startswith('..') else relative}")


def run_experiment(spec: ExperimentSpec, *, num_cpus: int | None = None,
                   echo: Callable[[str], None] | None = print, verbose: bool = True,
                   callbacks: list[Any] | None = None, config: Any = None) -> list[str]:
    """Runs the experiment with Tune; returns the recorded run directories.

    ``verbose=False`` keeps Ray, RLlib and Tune quiet in this process (``callbacks``, e.g. ``TrainProgress``,
    show progress instead): no worker logs forwarded, Tune's tables off, Ray's log level ERROR, warnings off.
    A trial that fails raises ``ConfigError`` naming its error and where Tune keeps the whole of it.
    ``config`` is ``build_config(spec)`` when the caller has built it already.
    """
    config = config if config is not None else build_config(spec)  # every check first: before Ray starts
    with _quiet_ray(verbose):
        import ray
        from ray import tune

        if not ray.is_initialized():
            # A trial needs what its algorithm asks Tune for (its own CPU, one per env runner, APPO's and
            # IMPALA's aggregator actors, evaluation runners); on a small machine ask Ray for that many logical
            # CPUs rather than leave the trial pending forever.
            needed = trial_cpus(config)
            ray.init(num_cpus=num_cpus or max(os.cpu_count() or 1, needed), include_dashboard=False,
                     log_to_driver=verbose, logging_level=logging.INFO if verbose else logging.ERROR)
        else:  # the caller's Ray: a trial it can't place would wait forever
            needed, has = trial_cpus(config), int(ray.cluster_resources().get("CPU", 0))
            if needed > has:
                raise ConfigError(f"experiment {spec.name!r}: a trial asks for {needed} CPUs (its algorithm, "
                                  f"{config.num_env_runners} env runner(s), learners and aggregators) and this Ray "
                                  f"cluster has {has}; start Ray with num_cpus={needed}, or lower num_env_runners "
                                  "or num_learners")
        if echo is not None:
            echo(describe(spec))
        tuner = tune.Tuner(
            spec.run, param_space=config,
            run_config=tune.RunConfig(
                name=spec.name, stop=spec.stop, verbose=1 if verbose else 0, callbacks=callbacks,
                storage_path=os.path.abspath(os.path.join(spec.recorder.output_dir, "_tune")),
            ),
        )
        results = tuner.fit()
    if results.errors:
        failed = next((r for r in results if r.error is not None), None)
        lines = [line.strip() for line in str(results.errors[0]).splitlines() if line.strip()]
        where = os.path.join(failed.path, "error.txt") if failed is not None and failed.path else None
        raise ConfigError(f"experiment {spec.name!r} failed: {lines[-1] if lines else results.errors[0]!r}"
                          + (f" (the whole error: {where})" if where and os.path.isfile(where) else ""))
    return sorted({r.metrics["recorder"]["run_dir"] for r in results if r.metrics and "recorder" in r.metrics})


@contextlib.contextmanager
def _quiet_ray(verbose: bool) -> Iterator[None]:
    """Tune's legacy reporter at verbosity 0 prints nothing (the new one still prints its tables); warnings off."""
    if verbose:
        yield
        return
    before = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if before is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = before


def trial_cpus(config: Any) -> int:
    """The CPUs one trial of ``config`` asks Tune for (its algorithm's ``default_resource_request``)."""
    try:
        request = config.algo_class.default_resource_request(config)
        return max(1, int(-(-float(request.required_resources.get("CPU", 1)) // 1)))
    except Exception:  # noqa: BLE001 - an algorithm of the user's that can't say: its runners and itself
        return 1 + int(config.num_env_runners or 0) + int(getattr(config, "evaluation_num_env_runners", 0) or 0)
