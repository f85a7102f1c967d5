"""A YAML's `multiagent:` block as RLlib's multi-agent settings: policy ids, and a mapping from agent to policy."""

from __future__ import annotations

from typing import Any

from rllib_recorder.commands.experiment import ExperimentSpec
from rllib_recorder.commands.messages import (
    SHOW,
    allowed_module,
    as_mapping,
    describe_value,
    did_you_mean,
    is_module_name,
    one_line,
)
from rllib_recorder.errors import ConfigError

MULTIAGENT_KEYS = ("policies", "policy_map_capacity", "policy_mapping_fn", "policies_to_train",
                   "policy_states_are_swappable", "count_steps_by")


class AgentToPolicy:
    """A picklable ``policy_mapping_fn`` from a YAML dict ``{agent_id: policy_id}``."""

    def __init__(self, mapping: dict[Any, str]):
        self.mapping = {str(k): str(v) for k, v in mapping.items()}

    def __call__(self, agent_id: Any, episode: Any = None, **kwargs: Any) -> str:
        try:
            return self.mapping[str(agent_id)]
        except KeyError:
            raise ConfigError(f"multiagent.policy_mapping_fn has no policy for agent {agent_id!r}; "
                              f"add '{agent_id}: <policy id>' to the YAML") from None


def multiagent_settings(value: Any, spec: ExperimentSpec) -> dict[str, Any]:
    at = f"{spec.where}: 'config: multiagent:'"
    multiagent = dict(as_mapping(value, at, "e.g. 'multiagent: {policies: [p0, p1], policy_mapping_fn: {0: p0, 1: p1}}'"))
    for key in multiagent:
        if key not in MULTIAGENT_KEYS:
            raise ConfigError(f"{at} unknown setting {SHOW.repr(key)}{did_you_mean(key, MULTIAGENT_KEYS)}; it "
                              f"takes {', '.join(MULTIAGENT_KEYS)}")
    policies = multiagent.get("policies")
    if policies is not None:
        if isinstance(policies, list):
            if not policies or not all(isinstance(p, str) and p for p in policies):
                raise ConfigError(f"{at} 'policies:' must list policy ids, e.g. 'policies: [p0, p1]'; it is "
                                  f"{describe_value(policies)}")
            multiagent["policies"] = set(policies)
        elif not isinstance(policies, dict) or not policies or not all(isinstance(p, str) for p in policies):
            raise ConfigError(f"{at} 'policies:' must list policy ids, e.g. 'policies: [p0, p1]'; it is "
                              f"{describe_value(policies)}")
    mapping = multiagent.get("policy_mapping_fn")
    if isinstance(mapping, dict) and set(mapping) == {"type"}:  # RLlib's YAML form: a callable class by path
        multiagent["policy_mapping_fn"] = _mapping_class(mapping["type"], at, spec)
        mapping = None
    elif mapping is not None:
        if not isinstance(mapping, dict) or not mapping or \
                not all(isinstance(p, str) and p for p in mapping.values()):
            raise ConfigError(f"{at} 'policy_mapping_fn:' must map agent ids to policy ids, e.g. "
                              f"'policy_mapping_fn: {{0: p0, 1: p1}}'; it is {describe_value(mapping)}")
        known = set(multiagent.get("policies") or mapping.values())
        missing = sorted(set(mapping.values()) - known)
        if missing:
            raise ConfigError(f"{at} 'policy_mapping_fn:' maps to policy {missing[0]!r}, which 'policies:' does not "
                              "list; add it there")
        multiagent["policy_mapping_fn"] = AgentToPolicy(mapping)
        multiagent["policies"] = set(multiagent.get("policies") or mapping.values())
    to_train = multiagent.get("policies_to_train")
    if to_train is not None and (not isinstance(to_train, list) or not all(isinstance(p, str) for p in to_train)):
        raise ConfigError(f"{at} 'policies_to_train:' must list policy ids; it is {describe_value(to_train)}")
    capacity = multiagent.get("policy_map_capacity")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ConfigError(f"{at} 'policy_map_capacity:' must be a number >= 1; it is {describe_value(capacity)}")
    if multiagent.get("count_steps_by", "env_steps") not in ("env_steps", "agent_steps"):
        raise ConfigError(f"{at} 'count_steps_by:' must be env_steps or agent_steps; it is "
                          f"{describe_value(multiagent['count_steps_by'])}")
    swappable = multiagent.get("policy_states_are_swappable", False)
    if not isinstance(swappable, bool):
        raise ConfigError(f"{at} 'policy_states_are_swappable:' must be true or false; it is {describe_value(swappable)}")
    return multiagent


def _mapping_class(path: Any, at: str, spec: ExperimentSpec) -> Any:
    """An instance of the callable class ``policy_mapping_fn: {type: pkg.module.Class}`` names (as RLlib's YAMLs
    gave it), imported only from ``ray.rllib`` or a ``register:`` module."""
    import importlib

    if not isinstance(path, str) or "." not in path or not is_module_name(path):
        raise ConfigError(f"{at} 'policy_mapping_fn: type:' must name a class as 'pkg.module.Class'; it is "
                          f"{describe_value(path)}")
    module, name = path.rsplit(".", 1)
    if not allowed_module(module, spec.register, ("ray.rllib",)):
        raise ConfigError(f"{at} 'policy_mapping_fn: type: {path}' would import module {module!r}, which the file "
                          f"does not list in 'register:'; add 'register: [{module}]' if you trust it")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{at} 'policy_mapping_fn: type: {path}' cannot be imported ({one_line(e)}); name a "
                          "class that exists, or map agents to policies: 'policy_mapping_fn: {0: p0, 1: p1}'") \
            from None
    try:
        instance = found() if isinstance(found, type) else None
    except Exception as e:  # noqa: BLE001 - the user's class: its error, in one line
        raise ConfigError(f"{at} 'policy_mapping_fn: type: {path}' could not be made ({one_line(e)})") from None
    if not callable(instance):
        raise ConfigError(f"{at} 'policy_mapping_fn: type: {path}' is not a callable class; name one whose "
                          "instances map (agent_id, episode) to a policy id")
    return instance
