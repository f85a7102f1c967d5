"""Hostile run directories: manifests, index files and names that try to run code, write outside, or crash a command.

Shared by ``tests/test_hostile.py`` (a few hundred derandomized examples in CI) and ``scripts/fuzz_hostile.py``
(thousands). Each example copies a real recorded run, makes one hostile change, runs one real command (in-process,
through click) or the reader API on it and checks what a recording must never do:

- a traceback, an exit code other than 0/1/2, or an exit 2 that is not one ``error: ...`` line;
- code named by the recording executed or imported: the sentinel module ``rr_sentinel`` (on ``sys.path``) writes
  ``SENTINEL`` when imported or called, ``env_config`` asks ``sh -c`` to write it too, an audit hook records
  every process started (only the project's own probe may be), and ``sys.modules`` shows any import of it;
- a file created, changed or removed outside the command's own output (the whole temporary root is hashed before
  and after, so ``../payload`` beside the run, the experiment dir and the target all count).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

SENTINEL = "SENTINEL-code-ran"
SENTINEL_MODULE = "rr_sentinel"
PROBE_COMMAND = "from rllib_recorder.format.probe import _main; _main()"
# processes libraries start on their own, whatever the recording holds: matplotlib asks platform.processor()
LIBRARY_COMMANDS = ("uname -p",)
SPAWN_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty")


@dataclass
class Events:
    """What the audit hook saw while armed."""

    armed: bool = False
    spawned: list[str] = field(default_factory=list)
    imported: list[str] = field(default_factory=list)


EVENTS = Events()
_HOOKED = False


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if not EVENTS.armed:
        return
    if event in SPAWN_EVENTS:
        argv = args[1] if event == "subprocess.Popen" and len(args) > 1 else args
        text = " ".join(map(str, argv if isinstance(argv, (list, tuple)) else [argv]))
        if PROBE_COMMAND not in text and text not in LIBRARY_COMMANDS:
            EVENTS.spawned.append(f"{event}: {text[:200]}")



def armed(fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` with the audit hook armed; imports of the sentinel module are found in ``sys.modules``
    (``importlib.import_module`` raises no audit event)."""
    for name in [m for m in sys.modules if m.split(".")[0] == SENTINEL_MODULE]:
        del sys.modules[name]
    EVENTS.spawned.clear(), EVENTS.imported.clear()
    EVENTS.armed = True
    try:
        return fn()
    finally:
        EVENTS.armed = False
        EVENTS.imported += [m for m in sys.modules if m.split(".")[0] == SENTINEL_MODULE]


def install(root: str) -> str:
    """Puts the sentinel module on ``sys.path`` (and PYTHONPATH, for children) and the audit hook in place;
    returns the sentinel file's path (it must never exist)."""
    global _HOOKED
    sentinel = os.path.join(root, SENTINEL)
    package = os.path.join(root, "sentinel-path")
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, f"{SENTINEL_MODULE}.py"), "w") as f:
        f.write(f"open({sentinel!r}, 'a').write('imported\\n')\n"
                f"def make(*a, **k):\n    open({sentinel!r}, 'a').write('called\\n')\n"
                "class Env:\n    def __init__(self, *a, **k):\n        make()\n")
    if package not in sys.path:
        sys.path.insert(0, package)
    os.environ["PYTHONPATH"] = os.pathsep.join([package, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if not _HOOKED:
        sys.addaudithook(_hook)
        _HOOKED = True
    return sentinel


# --------------------------------------------------------------------------------------------- hostile values

def hostile_values(sentinel: str) -> list[Any]:
    """Values that are wrong in type, size, sign or meaning, and names that point at code or outside the run."""
    shell = ["sh", "-c", f"echo shell >> {sentinel}"]
    return [
        None, True, False, 0, -1, -(2 ** 63), 2 ** 64, 10 ** 30, 1.5, -0.0, 1e308, "", " ", "null", "x" * 5000,
        "\x00", "\udcff" * 3, "é", [], [1, "a", None], {}, {"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}},
        "../payload.txt", "../../payload.txt", "/tmp/payload.txt", "worker-001.h5/../../payload.txt", ".", "..",
        "subprocess:Popen", "os:system", "builtins:exec", f"{SENTINEL_MODULE}:make", f"{SENTINEL_MODULE}:Env-v0",
        f"{SENTINEL_MODULE}:Env-v0-atari84x4", f"{SENTINEL_MODULE}.sub:make", "CartPole-v1", "$\\frac{a}{$",
        {"args": shell, "shell": False}, {"cmd": " ".join(shell)}, shell, dict.fromkeys(shell, 0), "__import__('os').system('true')",
        {"node_id": "../..", "node_ip": 1}, {"env_steps_sampled": "many"}, {"senders": []},
    ]


HOSTILE_NAMES = ["../payload.h5", "../../payload.h5", "/tmp/payload.h5", "worker-001.h5/../../x.h5", "",
                 "worker-1.h5", "worker-001.h5\x00", "..", "eval-worker-002.node1.h5/..", "x" * 300]


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in a JSON value (dict keys and list indices)."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):
            out += paths(v, prefix + (i,))
    return out


def mutate(manifest: dict[str, Any], rng: random.Random, sentinel: str) -> tuple[bytes, str]:
    """One hostile change to a copy of ``manifest``; (the manifest file's new bytes, what was done)."""
    doc = json.loads(json.dumps(manifest))
    kind = rng.choice(["set", "set", "set", "delete", "rename", "env", "files", "document", "several"])
    if kind == "document":
        raw = rng.choice([b"[]", b"42", b'"manifest"', b"null", b"{", b"", b"\xff\xfe\x00garbage",
                          b'{"format": "rllib_recorder", "schema_version": NaN}', b"[" * 100000 + b"]" * 100000,
                          json.dumps({**doc, "totals": float("inf")}).encode(),
                          b'{"format": "rllib_recorder"}', json.dumps(doc).encode()[: rng.randrange(1, 400)]])
        return raw, f"document {raw[:40]!r}"
    values = hostile_values(sentinel)
    if kind == "env":
        code = ["subprocess:Popen", "os:system", "builtins:exec", f"{SENTINEL_MODULE}:make", f"{SENTINEL_MODULE}:Env-v0",
                f"{SENTINEL_MODULE}:Env-v0-atari84x4", f"{SENTINEL_MODULE}.sub:make", "subprocess:Popen-atari84x4"]
        doc["env"] = rng.choice(code * 3 + [v for v in values if isinstance(v, str)] + [None, 3, ["CartPole-v1"]])
        doc["env_config"] = rng.choice([dict.fromkeys(["sh", "-c", f"echo shell >> {sentinel}"], 0)] * 3
                                       + [v for v in values if isinstance(v, (dict, type(None)))] + ["str", [1]])
        how = f"env={doc['env']!r:.60} env_config={doc['env_config']!r:.60}"
    elif kind == "files":
        files = doc.get("files") if isinstance(doc.get("files"), dict) else {}
        name = rng.choice(HOSTILE_NAMES)
        info = rng.choice([{}, {"node_id": rng.choice(["../..", "ab" * 28, 7, None])}, None, [], "x"])
        doc["files"] = {**files, name: info}
        how = f"files[{name!r:.60}]={info!r:.40}"
    else:
        how = []
        for _ in range(rng.randint(2, 5) if kind == "several" else 1):
            where = paths(doc)
            if not where:
                break
            path = rng.choice(where)
            parent = doc
            for key in path[:-1]:
                parent = parent[key]
            key = path[-1]
            if kind == "delete" and isinstance(parent, dict):
                parent.pop(key, None)
                how.append(f"del {'.'.join(map(str, path))}")
            elif kind == "rename" and isinstance(parent, dict):
                new = rng.choice(HOSTILE_NAMES + ["", "0", "-1"])
                parent[new] = parent.pop(key)
                how.append(f"rename {'.'.join(map(str, path))} -> {new!r:.40}")
            else:
                parent[key] = rng.choice(values)
                how.append(f"{'.'.join(map(str, path))} = {parent[key]!r:.60}")
        how = "; ".join(how) or "unchanged"
    return json.dumps(doc, default=str).encode("utf-8", "surrogatepass"), how


def hostile_index(rng: random.Random, run_name: str) -> bytes:
    """A hostile recorder_index.json for the experiment dir that holds the run."""
    runs = rng.choice([{run_name: {"run_dir": "../../payload"}}, {"../../payload": {}}, {"/etc": {}}, [], None,
                       {run_name: []}, {run_name: {"env_steps": "lots", "status": 7}}, {"": {}}, {"..": {}}, 5])
    doc = rng.choice([{"format": "rllib_recorder.format.index", "runs": runs}, [runs], {"format": 1}, "x"])
    return json.dumps(doc).encode()


# ------------------------------------------------------------------------------------------------ commands

def commands(run: str, experiment: str, out: str) -> list[tuple[str, list[str], list[str]]]:
    """(name, argv, directories the command may write) for every command that reads a run."""
    return [
        ("info", ["info", run], []), ("info --json", ["info", "--json", run], []), ("verify", ["verify", run], []),
        ("replay --check", ["replay", run, "--check"], []), ("replay", ["replay", run], []),
        ("export rllib", ["export", run, "--to", "rllib", "-o", os.path.join(out, "rllib")], [out]),
        ("export minari", ["export", run, "--to", "minari", "-o", os.path.join(out, "minari")], [out]),
        ("plot", ["plot", run, "-o", os.path.join(out, "run.png")], [out]),
        ("recover", ["recover", run], [run]), ("gather", ["gather", run, "--to", os.path.join(out, "g")], [out]),
        ("info experiment", ["info", experiment], []),
    ]


def snapshot(root: str, skip: list[str]) -> dict[str, str]:
    """sha256 of every file under ``root`` (but those under ``skip``), and every directory."""
    skip = [os.path.abspath(s) for s in skip]
    out = {}
    for base, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not any(os.path.abspath(os.path.join(base, d)).startswith(s) for s in skip)]
        out[base] = "dir"
        for name in names:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[path] = hashlib.sha256(f.read()).hexdigest()
    return out


@dataclass
class Outcome:
    command: str
    how: str
    exit_code: int
    violations: list[str]


def run_one(rng: random.Random, source_run: str, root: str, sentinel: str, i: int,
            only: Callable[[str], bool] = lambda name: True) -> Outcome:
    """One example: copy the run into ``root``, change it, run one command, check; the copy is removed after."""
    from click.testing import CliRunner

    from rllib_recorder.cli import main as cli

    example = os.path.join(root, f"ex{i}")
    experiment = os.path.join(example, "experiment")
    run = os.path.join(experiment, os.path.basename(source_run))
    out = os.path.join(example, "out")
    shutil.copytree(source_run, run)
    os.makedirs(out)
    with open(os.path.join(source_run, "manifest.json")) as f:
        manifest = json.load(f)
    target = rng.choice(["manifest", "manifest", "manifest", "index"])
    if target == "index":
        raw, how = hostile_index(rng, os.path.basename(run)), "index"
        path = os.path.join(experiment, "recorder_index.json")
    else:
        raw, how = mutate(manifest, rng, sentinel)
        path = os.path.join(run, "manifest.json")
    with open(path, "wb") as f:
        f.write(raw)
    name, argv, writable = rng.choice([c for c in commands(run, experiment, out) if only(c[0])])
    if target == "index":
        name, argv, writable = "info experiment", ["info", experiment], []
    before = snapshot(root, writable + [out])
    result = armed(lambda: CliRunner().invoke(cli, argv))
    violations = check_result(result)
    if os.path.exists(sentinel):
        violations.append(f"code from the recording ran: {open(sentinel).read().split()}")
        os.remove(sentinel)
    violations += [f"process started: {s}" for s in EVENTS.spawned]
    violations += [f"imported {m}" for m in EVENTS.imported]
    after = snapshot(root, writable + [out])
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    violations += [f"changed outside its output: {os.path.relpath(p, root)}" for p in changed[:5]]
    shutil.rmtree(example, ignore_errors=True)
    for stray in ("payload.txt", "payload.h5"):
        for base in (root, os.path.dirname(root)):
            if os.path.exists(os.path.join(base, stray)):
                violations.append(f"wrote {os.path.join(base, stray)}")
    return Outcome(name, how, result.exit_code, violations)


def check_result(result: Any) -> list[str]:
    """Violations of 'one line for bad input' in a click result."""
    problems = []
    output = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        problems.append(f"raised {type(result.exception).__name__}: {str(result.exception)[:200]}")
    if "Traceback" in output:
        problems.append("printed a traceback")
    if result.exit_code not in (0, 1, 2):
        problems.append(f"exit code {result.exit_code}")
    if result.exit_code == 2:
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        if len(errors) != 1 or not errors[0].startswith("error: "):
            problems.append(f"exit 2 without one 'error:' line: {result.stderr[-300:]!r}")
    return problems
