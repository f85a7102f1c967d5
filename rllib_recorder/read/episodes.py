"""Stitching an agent's episodes from their fragments: one by id, or all of a file streamed block by block.

An episode is the set of fragments with its ``eps_id``, ordered by ``t_start`` (docs/FORMAT.md). Streaming reads
the fragment index once and the step rows in blocks of whole fragments (``BLOCK_ROWS`` rows, about
``BLOCK_BYTES``), keeps a fragment's rows only until its episode's last fragment is read, and yields episodes in
the order their first fragment was stored: memory holds a block and the episodes still open, whatever the file's
size, and each row is read once (reading episode by episode through the index costs a read per column per
fragment, and a look-up in the whole index per episode).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from rllib_recorder.format import infos as infos_codec
from rllib_recorder.format.decode import read_node
from rllib_recorder.format.lag import step_lags
from rllib_recorder.read.records import MISSING, Episode, FileOfSteps

# A block is read at once: at most this many rows, and at most about BLOCK_BYTES of decoded step columns. Each
# block costs a read per column (HDF5's own per-call work, and a partial chunk at each end): CartPole's five
# columns read in blocks of 65,536 rows took 10.6 ms for 200,000 rows where one read of each took 8.6 ms.
BLOCK_ROWS = 1 << 20
BLOCK_BYTES = 16 << 20
STEP_NAMES = ("obs", "actions", "rewards", "terminateds", "truncateds", "t", "weights_seq_no", "env_t")
# The episode index columns streaming reads up front (module ids, strings, when an episode is first asked for one).
INDEX_NAMES = ("eps_id", "t_start", "num_rows", "first_row", "batch", "has_last_obs", "env_t_last_obs", "terminated",
               "truncated")
# What ``episodes(columns=...)`` may ask for: the step columns, and what each fragment stores beside its rows.
EPISODE_COLUMNS = (*STEP_NAMES, "extra_model_outputs", "infos", "policy_lag", "start_state")


class Fragments:
    """The rows of an agent's fragments, read in blocks of consecutive fragments (``_Block``) and handed out one
    fragment at a time: ``view(i)`` as a place in its block, ``take(i)`` as a dict of its rows (both forget what
    they hand out). ``only`` reads just those fragments (random access); ``columns`` reads only those step columns
    (``EPISODE_COLUMNS``; ``rewards`` always)."""

    def __init__(self, f: FileOfSteps, agent: str, frags: dict[str, np.ndarray], row_bytes: int,
                 only: Sequence[int] | None = None, decode: bool = True, learner: np.ndarray | None = None,
                 columns: Sequence[str] | None = None) -> None:
        self.frags, self.agent, self.worker = frags, agent, f.worker_index
        self.steps = f.h5[f"agents/{agent}/steps"]
        self.group = f.h5[f"agents/{agent}/fragments"]
        wanted = set(EPISODE_COLUMNS if columns is None else [*columns, "rewards"])
        if "policy_lag" in wanted:
            wanted.add("weights_seq_no")
        self.names = [n for n in STEP_NAMES if n in self.steps and n in wanted]
        self.extras = (list(self.steps["extra_model_outputs"]) if "extra_model_outputs" in self.steps
                       and "extra_model_outputs" in wanted else [])
        self.wanted = wanted
        self.learner = learner
        self.rows_per_block = int(min(BLOCK_ROWS, max(1, BLOCK_BYTES // max(row_bytes, 1))))
        self.only, self.decode = only, decode
        self._only = set(only) if only is not None else None
        self._block: _Block | None = None  # the block read last
        self._modules: list[str] | None = None
        self._references: dict[int, bytes] = {}  # start states others are stored against, by fragment row

    def block(self, i: int) -> "_Block":
        """The block holding fragment ``i`` (the one read last, or the next one read from ``i``)."""
        block = self._block
        if block is None or not block.i <= i < block.j:
            block = self._block = self._read_from(i)
        return block

    def take(self, i: int) -> dict[str, Any]:
        """Fragment ``i``'s rows, last observation, infos and start state, as a dict."""
        return self.block(i).part(i)

    def module_ids(self) -> list[str]:
        """Every fragment's module id (read once, when first asked for)."""
        if self._modules is None:
            column = self.frags.get("module_id")
            n = len(self.frags["eps_id"])
            if column is None:
                column = self.group["module_id"][:n] if "module_id" in self.group else [""] * n
            self._modules = [_text(m) for m in column]
        return self._modules

    def _read_from(self, i: int) -> "_Block":
        """Reads fragment ``i`` and the fragments after it that follow it in the file (streaming; random access:
        those asked for), up to a block's rows."""
        first, num = self.frags["first_row"], self.frags["num_rows"]
        j = i + 1
        # streaming: the fragments after it up to a block's rows; random access: those of them asked for too
        # (an episode's fragments, stored one after the other: one read per column, not one per fragment)
        while j < len(first) and (self._only is None or j in self._only) and \
                first[j] + num[j] - first[i] <= self.rows_per_block and first[j] == first[j - 1] + num[j - 1]:
            j += 1
        lo, hi = int(first[i]), int(first[j - 1] + num[j - 1])
        rows = slice(lo, hi)
        columns = {n: read_node(self.steps[n], rows, self.decode) for n in self.names}
        columns.update({"extra_model_outputs/" + k: read_node(self.steps["extra_model_outputs"][k], rows)
                        for k in self.extras})
        last_obs = (read_node(self.group["last_obs"], slice(i, j), self.decode)
                    if "last_obs" in self.group and "obs" in self.wanted else None)
        infos = self.group["infos"][i:j] if "infos" in self.group and "infos" in self.wanted else None
        coding = self.group["infos"].attrs.get("encoding") if infos is not None else None
        kinds = self.group["start_state_kind"][i:j] if "start_state_kind" in self.group and "start_state" in self.wanted \
            else None
        states = self.group["start_state"][i:j] if kinds is not None and any(kinds) else None  # one read a block
        states = _resolved(self.group, states, i, self._references) if states is not None else None
        return _Block(self.frags, i, j, lo, columns, last_obs, infos, coding, kinds, states, self.learner,
                      "policy_lag" in self.wanted, self.module_ids, self.agent, self.worker)


class _Block:
    """Consecutive fragments ``[i, j)`` as read: their step rows from row ``lo`` (``columns``), last observations,
    infos as stored and start states; an episode of one of them is a view into it (``EpisodeView``)."""

    __slots__ = ("frags", "i", "j", "lo", "columns", "last_obs", "infos", "coding", "kinds", "states", "learner",
                 "with_lag", "modules", "agent", "worker", "_firsts", "_obs", "_lags")

    def __init__(self, frags: dict[str, np.ndarray], i: int, j: int, lo: int, columns: dict[str, Any],
                 last_obs: Any, infos: Any, coding: Any, kinds: Any, states: Any, learner: np.ndarray | None,
                 with_lag: bool, modules: Any, agent: str = "", worker: int = 0) -> None:
        self.modules, self.agent, self.worker = modules, agent, worker
        ends = frags["first_row"][i:j] + frags["num_rows"][i:j] - lo
        self._firsts = ((frags["first_row"][i:j] - lo).tolist(), ends.tolist())  # rows of each fragment
        self.frags, self.i, self.j, self.lo, self.columns = frags, i, j, lo, columns
        self.last_obs, self.infos, self.coding, self.kinds, self.states = last_obs, infos, coding, kinds, states
        self.learner, self.with_lag = learner, with_lag
        self._obs: tuple[Any, np.ndarray] | None = None  # obs with each fragment's last row put after its rows
        self._lags: np.ndarray | None = None

    def rows(self, k: int) -> tuple[int, int]:
        firsts, ends = self._firsts
        return firsts[k - self.i], ends[k - self.i]

    def has_last(self, k: int) -> bool:
        return self.last_obs is not None and bool(self.frags["has_last_obs"][k])

    def obs(self, k: int) -> Any:
        """Fragment ``k``'s observations, its last one after them when stored: a view into the block's obs with
        every fragment's last observation put in place (made once a block, one copy)."""
        if self._obs is None:
            first = self.frags["first_row"][self.i:self.i + _count(self.last_obs)] - self.lo
            num = self.frags["num_rows"][self.i:self.i + _count(self.last_obs)]
            has = self.frags["has_last_obs"][self.i:self.i + len(num)].astype(bool) if self.last_obs is not None \
                else np.zeros(0, bool)
            ends = (first + num)[has]
            obs = self.columns["obs"] if not len(ends) else _insert(self.columns["obs"], ends,
                                                                     _pick(self.last_obs, np.flatnonzero(has)))
            shift = np.concatenate([[0], np.cumsum(has)]) if len(has) else np.zeros(1, np.int64)
            self._obs = (obs, shift)
        obs, shift = self._obs
        a, b = self.rows(k)
        at = a + int(shift[k - self.i]) if k - self.i < len(shift) else a
        return _rows(obs, at, b + (at - a) + int(self.has_last(k)))

    def policy_lag(self, k: int) -> np.ndarray:
        if self._lags is None:
            versions = self.columns["weights_seq_no"]
            frags = self.frags
            if self.learner is None:
                self._lags = np.full(len(versions), -1, np.int64)
            else:
                i, n = self.i, len(versions)
                count = int(np.searchsorted(frags["first_row"], self.lo + n, "left")) - i
                learner_rows = np.repeat(self.learner[frags["batch"][i:i + count]].astype(np.int64),
                                         frags["num_rows"][i:i + count])
                self._lags = step_lags(learner_rows[:n], versions)
        a, b = self.rows(k)
        return self._lags[a:b]

    def infos_of(self, k: int) -> Any:
        return infos_codec.loads(self.infos[k - self.i], self.coding) if self.infos is not None else None

    def start_state(self, k: int) -> tuple[str, bytes]:
        kind = self.kinds[k - self.i].decode() if self.kinds is not None else ""
        return kind, (self.states[k - self.i].tobytes() if kind and self.states is not None else b"")

    def part(self, k: int) -> dict[str, Any]:
        """Fragment ``k`` as a dict: its step rows, ``last_obs``, ``infos``, ``start_state`` (for stitching)."""
        a, b = self.rows(k)
        held = {n: _rows(v, a, b) for n, v in self.columns.items()}
        held["last_obs"] = (_rows(self.last_obs, k - self.i, k - self.i + 1) if self.last_obs is not None else None)
        held["infos"] = self.infos_of(k)
        held["start_state"] = self.start_state(k)
        return held


class EpisodeView:
    """The fields of an episode whose steps are one fragment, made from its block when first asked for."""

    __slots__ = ("block", "k", "a", "b", "eps_id")

    def __init__(self, block: _Block, k: int, eps_id: str) -> None:
        self.block, self.k, self.eps_id = block, k, eps_id
        self.a, self.b = block.rows(k)

    def field(self, name: str) -> Any:
        """Field ``name`` of the episode (``MISSING`` when the block does not hold it)."""
        block, k = self.block, self.k
        column = block.columns.get(name)
        if column is not None and name != "obs":
            return _rows(column, self.a, self.b)
        if name == "eps_id":
            return self.eps_id
        if name == "agent_id":
            return block.agent
        if name == "worker_index":
            return block.worker
        if name == "obs" and column is not None:
            return block.obs(k)
        if name == "extra_model_outputs":
            return {c.partition("/")[2]: _rows(v, self.a, self.b) for c, v in block.columns.items()
                    if c.startswith("extra_model_outputs/")}
        if name == "policy_lag" and block.with_lag and "weights_seq_no" in block.columns:
            return block.policy_lag(k)
        if name == "infos" and block.infos is not None:
            return block.infos_of(k)
        if name == "module_id":
            return block.modules()[k]
        if name in ("start_state_kind", "start_state") and block.kinds is not None and block.frags["t_start"][k] == 0:
            return block.start_state(k)[name == "start_state"]
        return MISSING


def _count(value: Any) -> int:
    while isinstance(value, (dict, tuple)):
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
    return 0 if value is None else len(value)


def _pick(value: Any, index: np.ndarray) -> Any:
    if isinstance(value, dict):
        return {key: _pick(v, index) for key, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_pick(v, index) for v in value)
    return value[index]


def _insert(value: Any, at: np.ndarray, rows: Any) -> Any:
    """``value`` with ``rows`` put before rows ``at`` (one copy)."""
    if isinstance(value, dict):
        return {key: _insert(v, at, rows[key]) for key, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_insert(v, at, r) for v, r in zip(value, rows))
    return np.insert(value, at, rows, axis=0)


def _resolved(group: Any, states: np.ndarray, i: int, references: dict[int, bytes]) -> list[np.ndarray]:
    """Start states of fragment rows ``i, i + 1, ...`` as blobs that read on their own (``start_state.resolve``:
    schema 3.0 stores most against an earlier one of their file); ``references``: those read before, by row."""
    from rllib_recorder.errors import ReplayError
    from rllib_recorder.format import start_state

    out = []
    for k, state in enumerate(states):
        blob = state.tobytes()
        try:
            back = start_state.ref_back(blob) if len(blob) else 0
            row = i + k - back
            if back and row >= 0:
                if row not in references:
                    if len(references) >= 64:
                        references.clear()
                    references[row] = states[row - i].tobytes() if row >= i else group["start_state"][row].tobytes()
                blob = start_state.resolve(blob, references[row])
        except ReplayError:  # a damaged state: kept as stored, and named when something restores it
            pass
        out.append(np.frombuffer(blob, np.uint8))
    return out


def assemble(f: FileOfSteps, eps_id: str, agent: str, frags: dict[str, np.ndarray], where: Sequence[int],
             parts: Sequence[dict[str, Any]], learner: np.ndarray | None, module_id: str | None = None) -> Episode:
    """An episode from its fragments' rows ``parts`` (in ``t_start`` order, fragment rows ``where``); a column
    the parts do not hold (``episodes(columns=...)``) is left out (empty). ``module_id``: when ``frags`` lacks it."""
    def cat(name: str) -> Any:
        return concat_values([p[name] for p in parts])

    last = where[-1]
    values: dict[str, Any] = {name: cat(name) for name in ("actions", "rewards", "terminateds", "truncateds", "t",
                                                          "weights_seq_no") if name in parts[0]}
    if "obs" in parts[0]:
        obs = cat("obs")
        if frags["has_last_obs"][last] and parts[-1]["last_obs"] is not None:
            obs = concat_values([obs, parts[-1]["last_obs"]])
        values["obs"] = obs
    if parts[0]["infos"] is not None:
        infos: list[Any] = []
        for p in parts:
            infos.extend(p["infos"] if not infos else p["infos"][1:])
        values["infos"] = infos
    values["start_state_kind"], values["start_state"] = (parts[0]["start_state"] if frags["t_start"][where[0]] == 0
                                                         else ("", b""))
    if "weights_seq_no" in values:
        versions = values["weights_seq_no"]
        learner_rows = (np.repeat(learner[frags["batch"][where]].astype(np.int64), frags["num_rows"][where])
                        if learner is not None else np.full(len(versions), -1))
        values["policy_lag"] = step_lags(learner_rows, versions)
    if "env_t" in parts[0] and "env_t_last_obs" in frags:
        pieces = []
        for j, p in enumerate(parts):
            piece = p["env_t"].astype(np.int64)
            if len(piece) and piece[0] < 0 and j:  # older than the sampled episode's map: the previous last_obs
                piece[0] = frags["env_t_last_obs"][where[j - 1]]
            pieces.append(piece)
        if frags["env_t_last_obs"][last] >= 0:
            pieces.append(np.array([frags["env_t_last_obs"][last]], np.int64))
        values["env_t"] = np.concatenate(pieces)
    values["extra_model_outputs"] = {k.partition("/")[2]: cat(k) for k in parts[0] if k.startswith("extra_model_outputs/")}
    module = frags.get("module_id")
    values["module_id"] = module_id if module_id is not None else _text(module[last]) if module is not None else ""
    return Episode(eps_id=eps_id, agent_id=agent, worker_index=f.worker_index, **values)


def iter_episodes(f: FileOfSteps, agent: str, frags: dict[str, np.ndarray], row_bytes: int,
                  learner: np.ndarray | None, decode: bool = True,
                  columns: Sequence[str] | None = None) -> Iterator[Episode]:
    """Every episode of ``agent`` in ``f``, streamed (module docstring), in the order its first fragment was stored.

    An episode whose steps are one fragment (most are) is a view into its block, its fields made when asked for
    (``EpisodeView``); one of several fragments is stitched (copied) once its last fragment is read. ``columns``:
    the step columns to read (``EPISODE_COLUMNS``); the others come empty."""
    n = len(frags["eps_id"])
    if not n:
        return
    ids, first_index, inverse, counts = np.unique(frags["eps_id"], return_index=True, return_inverse=True,
                                                  return_counts=True)
    last_of = np.full(len(ids), -1, np.int64)
    np.maximum.at(last_of, inverse, np.arange(n))
    rank = np.empty(len(ids), np.int64)
    rank[np.argsort(first_index, kind="stable")] = np.arange(len(ids))
    alone = (counts[inverse] == 1) & ("env_t" not in f.h5[f"agents/{agent}/steps"])
    reader = Fragments(f, agent, frags, row_bytes, decode=decode, learner=learner, columns=columns)
    names = [eps.decode() for eps in ids.tolist()]
    open_: dict[int, list[int]] = {}
    held: dict[int, list[dict[str, Any]]] = {}
    ready: dict[int, Episode] = {}
    next_rank = 0
    inverse_list, rank_list, alone_list = inverse.tolist(), rank.tolist(), alone.tolist()
    lengths = frags["num_rows"].tolist()
    new, set_values, set_make, set_n = object.__new__, Episode._values.__set__, Episode._make.__set__, \
        Episode._n.__set__
    block = None
    for i in range(n):
        e = inverse_list[i]
        if alone_list[i]:  # the whole episode in one fragment: a view, nothing copied, read or parsed yet
            if block is None or i >= block.j or i < block.i:
                block = reader.block(i)
            episode = new(Episode)
            set_values(episode, None)
            set_make(episode, EpisodeView(block, i, names[e]))
            set_n(episode, lengths[i])
            if rank_list[e] == next_rank and not ready:
                yield episode
                next_rank += 1
                continue
            ready[rank_list[e]] = episode
        else:
            open_.setdefault(e, []).append(i)
            held.setdefault(e, []).append(reader.take(i))
            if i != last_of[e]:
                continue
            where, parts = open_.pop(e), held.pop(e)
            if len(where) > 1:
                order = np.argsort(frags["t_start"][where], kind="stable")
                where, parts = [where[k] for k in order], [parts[k] for k in order]
            ready[rank_list[e]] = assemble(f, names[e], agent, frags, where, parts, learner,
                                           reader.module_ids()[where[-1]])
        while next_rank in ready:
            yield ready.pop(next_rank)
            next_rank += 1


def _rows(value: Any, a: int, b: int) -> Any:
    if type(value) is np.ndarray:  # the common case first: no ABC checks
        return value[a:b]
    if isinstance(value, dict):
        return {k: _rows(v, a, b) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_rows(v, a, b) for v in value)
    return value[a:b]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def concat_values(parts: list[Any]) -> Any:
    first = parts[0]
    if type(first) is np.ndarray:  # a copy, also of one part: an episode kept must not keep its block
        return first.copy() if len(parts) == 1 else np.concatenate(parts)
    if isinstance(first, dict):
        return {k: concat_values([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return tuple(concat_values([p[i] for p in parts]) for i in range(len(first)))
    return np.concatenate(parts)
