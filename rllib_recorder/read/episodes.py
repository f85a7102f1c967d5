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
from rllib_recorder.format.lag import step_lags
from rllib_recorder.read.records import Episode, FileOfSteps

# A block is read at once: at most this many rows, and at most about BLOCK_BYTES of decoded step columns.
BLOCK_ROWS = 65_536
BLOCK_BYTES = 16 << 20
STEP_NAMES = ("obs", "actions", "rewards", "terminateds", "truncateds", "t", "weights_seq_no", "env_t")


class Fragments:
    """The rows of an agent's fragments, read in blocks of consecutive fragments and handed out one fragment at a
    time (``take(i)`` forgets what it hands out). ``only`` reads just those fragments (random access)."""

    def __init__(self, f: FileOfSteps, agent: str, frags: dict[str, np.ndarray], row_bytes: int,
                 only: Sequence[int] | None = None, decode: bool = True) -> None:
        from rllib_recorder.read.worker_file import read_node

        self._read_node = read_node
        self.frags = frags
        self.steps = f.h5[f"agents/{agent}/steps"]
        self.group = f.h5[f"agents/{agent}/fragments"]
        self.names = [n for n in STEP_NAMES if n in self.steps]
        self.extras = list(self.steps["extra_model_outputs"]) if "extra_model_outputs" in self.steps else []
        self.rows_per_block = int(min(BLOCK_ROWS, max(1, BLOCK_BYTES // max(row_bytes, 1))))
        self.only, self.decode = only, decode
        self._held: dict[int, dict[str, Any]] = {}
        self._references: dict[int, bytes] = {}  # start states others are stored against, by fragment row

    def take(self, i: int) -> dict[str, Any]:
        if i not in self._held:
            self._read_from(i)
        return self._held.pop(i)

    def _read_from(self, i: int) -> None:
        """Reads fragment ``i`` and, streaming, the fragments after it up to a block's rows."""
        first, num = self.frags["first_row"], self.frags["num_rows"]
        j = i + 1
        if self.only is None:
            while j < len(first) and first[j] + num[j] - first[i] <= self.rows_per_block and first[j] == (
                    first[j - 1] + num[j - 1]):
                j += 1
        lo, hi = int(first[i]), int(first[j - 1] + num[j - 1])
        rows = slice(lo, hi)
        columns = {n: self._read_node(self.steps[n], rows, self.decode) for n in self.names}
        columns.update({"extra_model_outputs/" + k: self._read_node(self.steps["extra_model_outputs"][k], rows)
                        for k in self.extras})
        last_obs = (self._read_node(self.group["last_obs"], slice(i, j), self.decode) if "last_obs" in self.group
                    else None)
        infos = self.group["infos"][i:j] if "infos" in self.group else None
        coding = self.group["infos"].attrs.get("encoding") if infos is not None else None
        kinds = self.group["start_state_kind"][i:j] if "start_state_kind" in self.group else None
        states = self.group["start_state"][i:j] if kinds is not None and any(kinds) else None  # one read a block
        states = _resolved(self.group, states, i, self._references) if states is not None else None
        for k in range(i, j):
            a, b = int(first[k]) - lo, int(first[k] + num[k]) - lo
            held = {n: _rows(v, a, b) for n, v in columns.items()}
            held["last_obs"] = _rows(last_obs, k - i, k - i + 1) if last_obs is not None else None
            held["infos"] = infos_codec.loads(infos[k - i], coding) if infos is not None else None
            kind = kinds[k - i].decode() if kinds is not None else ""
            held["start_state"] = (kind, states[k - i].tobytes() if kind and states is not None else b"")
            self._held[k] = held


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
             parts: Sequence[dict[str, Any]], learner: np.ndarray | None) -> Episode:
    """An episode from its fragments' rows ``parts`` (in ``t_start`` order, fragment rows ``where``)."""
    cat = lambda name: concat_values([p[name] for p in parts])  # noqa: E731
    last = where[-1]
    obs = cat("obs")
    if frags["has_last_obs"][last] and parts[-1]["last_obs"] is not None:
        obs = concat_values([obs, parts[-1]["last_obs"]])
    infos = None
    if parts[0]["infos"] is not None:
        infos = []
        for p in parts:
            infos.extend(p["infos"] if not infos else p["infos"][1:])
    kind, state = parts[0]["start_state"] if frags["t_start"][where[0]] == 0 else ("", b"")
    versions = cat("weights_seq_no")
    learner_rows = (np.repeat(learner[frags["batch"][where]].astype(np.int64), frags["num_rows"][where])
                    if learner is not None else np.full(len(versions), -1))
    env_t = np.zeros(0, np.int64)
    if "env_t" in parts[0] and "env_t_last_obs" in frags:
        pieces = []
        for j, p in enumerate(parts):
            piece = p["env_t"].astype(np.int64)
            if len(piece) and piece[0] < 0 and j:  # older than the sampled episode's map: the previous last_obs
                piece[0] = frags["env_t_last_obs"][where[j - 1]]
            pieces.append(piece)
        if frags["env_t_last_obs"][last] >= 0:
            pieces.append(np.array([frags["env_t_last_obs"][last]], np.int64))
        env_t = np.concatenate(pieces)
    module = frags.get("module_id")
    return Episode(
        eps_id=eps_id, agent_id=agent, worker_index=f.worker_index, obs=obs, env_t=env_t,
        start_state_kind=kind, start_state=state, policy_lag=step_lags(learner_rows, versions),
        actions=cat("actions"), rewards=cat("rewards"), terminateds=cat("terminateds"),
        truncateds=cat("truncateds"), t=cat("t"), weights_seq_no=versions,
        extra_model_outputs={k.partition("/")[2]: cat(k) for k in parts[0] if k.startswith("extra_model_outputs/")},
        infos=infos, module_id=_text(module[last]) if module is not None else "",
    )


def iter_episodes(f: FileOfSteps, agent: str, frags: dict[str, np.ndarray], row_bytes: int,
                  learner: np.ndarray | None, decode: bool = True) -> Iterator[Episode]:
    """Every episode of ``agent`` in ``f``, streamed (module docstring), in the order its first fragment was stored."""
    n = len(frags["eps_id"])
    if not n:
        return
    ids, first_index, inverse = np.unique(frags["eps_id"], return_index=True, return_inverse=True)
    last_of = np.full(len(ids), -1, np.int64)
    np.maximum.at(last_of, inverse, np.arange(n))
    rank = np.empty(len(ids), np.int64)
    rank[np.argsort(first_index, kind="stable")] = np.arange(len(ids))
    reader = Fragments(f, agent, frags, row_bytes, decode=decode)
    open_: dict[int, list[int]] = {}
    held: dict[int, list[dict[str, Any]]] = {}
    ready: dict[int, Episode] = {}
    next_rank = 0
    for i in range(n):
        e = int(inverse[i])
        open_.setdefault(e, []).append(i)
        held.setdefault(e, []).append(reader.take(i))
        if i != last_of[e]:
            continue
        where, parts = open_.pop(e), held.pop(e)
        if len(where) > 1:
            order = np.argsort(frags["t_start"][where], kind="stable")
            where, parts = [where[k] for k in order], [parts[k] for k in order]
        ready[int(rank[e])] = assemble(f, ids[e].decode(), agent, frags, where, parts, learner)
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
