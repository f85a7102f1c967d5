"""An env's start state: captured in the env runner when an episode starts, restored in a fresh env to re-simulate
it.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import numpy as np

from rllib_recorder.errors import ReplayError
from rllib_recorder.format.start_state import KIND_ALE, KIND_CLASSIC, pack, unpack

# Wrapper attributes that shape later observations (gymnasium's TimeLimit, RLlib's Atari wrappers).
WRAPPER_ATTRS = ("frames", "lives", "was_real_terminated", "_obs_buffer", "_elapsed_steps")

# Wrapper attributes a full env step overwrites before reading them (RLlib's MaxAndSkipEnv max-pools the last two
# raw frames of each step into ``_obs_buffer``): they shape an observation only if the episode's first step ends
# it part-way through the skipped frames, so they are stored only for such episodes (``Captured.pack``).
FIRST_STEP_ONLY_ATTRS = ("_obs_buffer",)

# Attributes of a classic-control env besides its ``state`` array.
CLASSIC_ATTRS = ("steps_beyond_terminated",)


def sub_envs(vector_env: Any) -> Any | None:
    """The sub-envs of the gymnasium vector env RLlib passes to ``on_episode_start`` (None if they are remote)."""
    return getattr(getattr(vector_env, "unwrapped", vector_env), "envs", None)


def unsupported_reason(env: Any) -> str | None:
    """Why ``env``'s state can't be captured (None when it can)."""
    base = getattr(env, "unwrapped", env)
    if hasattr(base, "ale"):
        return None
    state = getattr(base, "state", None)
    if state is not None and np.asarray(state).dtype.kind in "fiub":
        return None
    return (f"{type(base).__name__} has neither an ALE emulator nor a classic-control 'state' array; "
            "only such envs can be restored")


class Captured:
    """An env's state as captured at episode start: the values read (arrays copied), nothing built yet.

    A capture runs on every episode start, between env steps and forward passes that leave the CPU's caches
    cold: there every Python operation costs several times its price in a loop (a capture took 47 us of a live
    CartPole runner's CPU, 5 us in a loop). So it only reads and copies; the blob's ``arrays`` and ``meta`` are
    built when first asked for, at packing, in the conversion's loop over a sample's episodes. Never changed
    after capture. Pickles as its built form (it keeps the env's plan, whose weak references don't pickle).
    """

    __slots__ = ("kind", "_plan", "_values", "_built")

    def __init__(self, kind: str, plan: "_Plan | None", values: tuple,
                 built: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None) -> None:
        self.kind = kind
        self._plan = plan
        self._values = values
        self._built = built

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return self._build()[0]

    @property
    def meta(self) -> dict[str, Any]:
        return self._build()[1]

    def _build(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if self._built is None:
            plan, (layer_values, rng, core, base_values) = self._plan, self._values
            arrays: dict[str, np.ndarray] = {}
            layers = []
            for (index, name, names, _), values in zip(plan.layers, layer_values):
                attrs = {a: _ref(arrays, f"L{index}.{a}", v) for a, v in zip(names, values) if v is not _ABSENT}
                if attrs:
                    layers.append([name, attrs])
            meta: dict[str, Any] = {"layers": layers, "rng": rng}
            if self.kind == KIND_ALE:
                arrays["ale"] = np.frombuffer(core, np.uint8)
            else:
                arrays["state"] = core
                meta["attrs"] = {n: _ref(arrays, f"base.{n}", v) for n, v in zip(plan.base_attrs, base_values)}
            self._built, self._plan, self._values = (arrays, meta), None, ()
        return self._built

    def pack(self, first_step_ended: bool = True) -> bytes:
        """The state blob; ``FIRST_STEP_ONLY_ATTRS`` only if the episode's first step ended it."""
        arrays, meta = self._build()
        if first_step_ended or not any(a in attrs for _, attrs in meta["layers"] for a in FIRST_STEP_ONLY_ATTRS):
            return pack(arrays, meta)  # (classic-control envs never hold them)
        layers, dropped = [], set()
        for name, attrs in meta["layers"]:
            kept = {a: ref for a, ref in attrs.items() if a not in FIRST_STEP_ONLY_ATTRS}
            dropped.update(_array_keys(ref) for a, ref in attrs.items() if a in FIRST_STEP_ONLY_ATTRS)
            if kept:
                layers.append([name, kept])
        arrays = {k: v for k, v in arrays.items() if k not in dropped}
        return pack(arrays, {**meta, "layers": layers})

    def __deepcopy__(self, memo: dict) -> "Captured":
        return self  # never changed after capture; RLlib deep-copies custom_data whenever it cuts an episode

    def __reduce__(self) -> tuple:
        return Captured, (self.kind, None, (), self._build())


def capture(env: Any) -> tuple[str, bytes] | None:
    """(kind, state bytes) of ``env`` as it is now, or None if the env is not supported."""
    captured = capture_state(env)
    return None if captured is None else (captured.kind, captured.pack())


def capture_state(env: Any) -> Captured | None:
    """``env``'s state as it is now (values read and arrays copied, nothing packed), or None if the env is not
    supported."""
    plan = plan_of(env)
    return None if plan is None else plan.capture()


class _Plan:
    """What ``capture_state`` reads of one env, found once: its wrapper stack does not change after it is built,
    and a capture runs on every episode start. Live, in an env runner, the walk through the wrappers and the
    lookups cost more than the copies (a capture took 40 us there, 3.4 us in a loop).

    Holds the env, its base env and the wrappers it reads only through weak references, so that a plan never
    keeps an env alive (an env RLlib recreates gets a new plan; the old one goes with its env).
    """

    __slots__ = ("kind", "layers", "base", "base_attrs", "env", "ale_rng")

    def __init__(self, env: Any, weak: bool) -> None:
        ref = weakref.ref if weak else _Strong
        base = env.unwrapped
        layers = []
        for index, layer in enumerate(_layers(env)):
            names = tuple(name for name in WRAPPER_ATTRS if name in vars(layer))
            if names:  # (position in the stack of wrappers, its type name, the WRAPPER_ATTRS it has, the wrapper)
                layers.append((index, type(layer).__name__, names, ref(layer)))
        self.kind = KIND_ALE if hasattr(base, "ale") else KIND_CLASSIC
        self.layers: tuple[tuple[int, str, tuple[str, ...], Any], ...] = tuple(layers)
        self.base = ref(base)
        self.base_attrs = () if self.kind == KIND_ALE else tuple(n for n in CLASSIC_ATTRS if hasattr(base, n))
        self.env: Any = None
        # ALE draws from its own generator on every frame, but only sticky actions (repeat_action_probability > 0)
        # let the draw change anything; without them the generator's state (7 kB of decimal text, new at every
        # episode start) is left out of the captured state, which then repeats but 100 bytes of the one before.
        self.ale_rng = self.kind != KIND_ALE or _sticky_actions(base)

    def capture(self) -> Captured | None:
        """The env's state as it is now (``capture_state``); None if the env is gone. One call does all the
        reading: live, every further Python call and lookup here costs several times its price in a loop."""
        base = self.base()
        if base is None:
            return None
        layer_values = []
        for _, _, names, layer in self.layers:
            values = layer().__dict__
            layer_values.append([_snap(values[a]) if a in values else _ABSENT for a in names])
        rng = getattr(base, "_np_random", None)  # gymnasium's Env keeps its generator there (None before seeding)
        rng = None if rng is None else rng.bit_generator.state
        if self.kind == KIND_ALE:
            return Captured(KIND_ALE, self, (layer_values, rng, base.ale.cloneState(include_rng=self.ale_rng).serialize(),
                                             ()))
        return Captured(KIND_CLASSIC, self,
                        (layer_values, rng, np.array(base.state), [_snap(getattr(base, n)) for n in self.base_attrs]))


def _sticky_actions(base: Any) -> bool:
    """Whether an ALE env repeats actions at random (its generator then shapes the episode); True when unsure."""
    try:
        return float(base.ale.getFloat("repeat_action_probability")) > 0.0
    except Exception:  # noqa: BLE001 - an ALE without the setting: keep the generator
        return True


class _Strong:
    """A strong reference with a weak reference's call: for the plan of an env that can't be weakly referenced
    (never remembered)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


# Plans by id(env), each with a weak reference to its env (checked on every lookup: an id can be reused) whose
# callback drops the plan when the env goes. A WeakKeyDictionary lookup builds a weak reference every time.
_PLANS: dict[int, _Plan] = {}


def plan_of(env: Any) -> _Plan | None:
    """``env``'s capture plan (made on first use), or None if the env is not supported (not remembered: a
    classic-control env has no state before its first reset)."""
    key = id(env)
    plan = _PLANS.get(key)
    if plan is not None and plan.env() is env:
        return plan
    if unsupported_reason(env) is not None:
        return None
    try:
        plan = _Plan(env, weak=True)
        plan.env = weakref.ref(env, lambda _, key=key: _forget_plan(key))
    except TypeError:  # not weakly referable: plan every time
        return _Plan(env, weak=False)
    _PLANS[key] = plan
    return plan


def _forget_plan(key: int) -> None:
    plan = _PLANS.get(key)
    if plan is not None and plan.env() is None:  # not a newer env's plan under a reused id
        del _PLANS[key]


def restore(env: Any, kind: str, state: bytes) -> None:
    """Puts a fresh (already reset) ``env`` into a captured state; ReplayError if it does not fit."""
    reason = unsupported_reason(env)
    if reason is not None:
        raise ReplayError(f"cannot restore a recorded start state into this env: {reason}")
    base = env.unwrapped
    if kind not in (KIND_ALE, KIND_CLASSIC) or (kind == KIND_ALE) != hasattr(base, "ale"):
        raise ReplayError(f"the recorded start state is of kind {kind!r}, but the env is {type(base).__name__}; "
                          "pass the env the run was recorded with (--env)")
    arrays, meta = unpack(state)
    layers = _layers(env)
    for name, attrs in meta["layers"]:
        layer = next((x for x in layers if type(x).__name__ == name), None)
        if layer is None:
            raise ReplayError(f"the recorded env had a {name} wrapper, the given env has none; "
                              "pass the env the run was recorded with (--env)")
        layers.remove(layer)
        for attr, value in attrs.items():
            setattr(layer, attr, _get(arrays, value, getattr(layer, attr, None)))
    if meta.get("rng") is not None:
        base.np_random.bit_generator.state = meta["rng"]
    if kind == KIND_ALE:
        import ale_py

        base.ale.restoreState(ale_py.ALEState(arrays["ale"].tobytes()))
    else:
        if np.shape(base.state) != arrays["state"].shape:
            raise ReplayError(f"the recorded state has shape {arrays['state'].shape}, the env's "
                              f"{np.shape(base.state)}; pass the env the run was recorded with (--env)")
        base.state = arrays["state"].copy()
        for attr, value in meta.get("attrs", {}).items():
            setattr(base, attr, _get(arrays, value, None))


def _layers(env: Any) -> list[Any]:
    layers, layer = [], env
    while layer is not None and layer not in layers:
        layers.append(layer)
        layer = getattr(layer, "env", None)
    return layers


# A wrapper attribute the plan names that the wrapper does not have at this capture.
_ABSENT = object()

# Values stored inline in the meta as they are (the common case: a TimeLimit's step count).
_INLINE = frozenset((int, float, bool, str, type(None)))


class _Frames:
    """A deque of arrays as captured: its items stacked, or its one item when a reset repeated it."""

    __slots__ = ("stacked", "maxlen", "repeat")

    def __init__(self, items: deque) -> None:
        items_ = list(items)
        self.maxlen = items.maxlen
        self.repeat = 0
        if len(items_) > 1 and all(_same(items_[0], item) for item in items_[1:]):
            # a frame stack just after a reset holds its first frame K times: stored once (a quarter of the bytes
            # to copy and compress on every episode start of an Atari env)
            self.stacked, self.repeat = np.array(items_[0])[None], len(items_)
        else:
            self.stacked = np.stack(items_) if items_ else np.zeros(0)


def _snap(value: Any) -> Any:
    """``value`` as it is now: arrays copied (wrappers update their buffers in place), numpy scalars as Python's."""
    if type(value) in _INLINE:
        return value
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, deque):
        return _Frames(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def _ref(arrays: dict[str, np.ndarray], key: str, value: Any) -> Any:
    """JSON-able reference to a ``_snap``: plain values inline, arrays (and deques of arrays) in ``arrays``."""
    if isinstance(value, np.ndarray):
        arrays[key] = value
        return {"array": key}
    if isinstance(value, _Frames):
        arrays[key] = value.stacked
        ref = {"deque": key, "maxlen": value.maxlen}
        if value.repeat:
            ref["repeat"] = value.repeat
        return ref
    return value


def _same(a: Any, b: Any) -> bool:
    """Whether two deque items are the same array, bit for bit (the same object, as FrameStack's reset appends)."""
    if a is b:
        return True
    return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
            and a.tobytes() == b.tobytes())


def _array_keys(ref: Any) -> str | None:
    """The ``arrays`` key a ``_ref`` reference names (None for an inline value)."""
    return ref.get("deque", ref.get("array")) if isinstance(ref, dict) else None


def _get(arrays: dict[str, np.ndarray], ref: Any, current: Any) -> Any:
    if isinstance(ref, dict) and "deque" in ref:
        items = arrays[ref["deque"]]
        if "repeat" in ref:
            return deque([items[0].copy() for _ in range(ref["repeat"])], maxlen=ref["maxlen"])
        return deque(list(items), maxlen=ref["maxlen"])
    if isinstance(ref, dict) and "array" in ref:
        return arrays[ref["array"]].copy()
    return ref
