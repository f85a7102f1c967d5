"""A YAML's `multiagent:` block as RLlib's multi-agent settings: policy ids, and a mapping from agent to policy."""

from __future__ import annotations

from typing import Any

from rllib_recorder.commands.experiment import ExperimentSpec
from rllib_recorder.commands.messages import (
    SHOW,
    as_mapping,
    describe_value,
    did_you_mean,
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
    if mapping is not None:
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
