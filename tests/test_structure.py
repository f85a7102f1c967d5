"""The package's shape: imports point one way between its folders, and every private RLlib/Ray/Tune access still
exists in the installed Ray."""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "rllib_recorder")
# What each folder may import from the package (beside config, errors, extras and _rllib_compat, which import
# nothing of it but errors). The write side (record, service) and the read side (read) meet only in format.
ALLOWED = {
    "format": {"format"},
    "record": {"format", "record"},
    "service": {"format", "record", "service"},
    "read": {"format", "read"},
    "commands": {"format", "record", "service", "read", "commands", "callback", "view"},
    "view": {"read", "view"},  # the viewer is one more reader (DESIGN 11); commands/view.py hands it the rest
    "callback": {"record", "service"},
    "cli": {"commands", "read", "service"},
    "__init__": {"callback", "read"},  # the package's face, imported lazily
}
BASE = {"config", "errors", "extras", "_rllib_compat", "version"}


def package_imports(path: str) -> set[str]:
    """The top-level parts of the package (``format``, ``config``, ...) a module imports, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rllib_recorder"):
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("rllib_recorder."))
    return found


def modules() -> list[tuple[str, str]]:
    out = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                part = os.path.relpath(path, PACKAGE).split(os.sep)[0].removesuffix(".py")
                out.append((part, path))
    return out


@pytest.mark.parametrize("part, path", modules(), ids=[os.path.relpath(p, PACKAGE) for _, p in modules()])
def test_imports_point_one_way(part, path):
    imported = package_imports(path) - BASE - {"__version__", "__init__"}
    if part in BASE:
        assert not imported, f"{os.path.relpath(path, ROOT)} imports {sorted(imported)}; it must import none of them"
        return
    wrong = imported - ALLOWED[part]
    assert not wrong, (f"{os.path.relpath(path, ROOT)} ({part}/) imports {sorted(wrong)}; {part}/ may import only "
                       f"{sorted(ALLOWED[part])}")


def test_no_module_is_named_like_a_standard_library_module():
    import sys

    clashes = sorted({os.path.basename(p)[:-3] for _, p in modules()} & set(sys.stdlib_module_names) - {"__init__"})
    assert not clashes, f"modules named like the standard library's: {clashes}"


@pytest.mark.compat
def test_every_private_rllib_ray_and_tune_access_still_exists():
    from rllib_recorder._rllib_compat import problems

    assert problems() == []


@pytest.mark.compat
def test_no_module_but_the_compat_one_reaches_into_ray_privately():
    """Private names of ray (``_global_registry``, ``ray._common``, ``_storage``, ...) only in _rllib_compat.py."""
    private = ("_global_registry", "ray._common", "._storage", "_weights_seq_no", "_ts_dropped",
               "_translate_special_keys", "_generator_backpressure", "_to_flush", '"_storage"')
    for _, path in modules():
        if os.path.basename(path) == "_rllib_compat.py":
            continue
        text = open(path).read()
        found = [p for p in private if re.search(r"(?<!\w)" + re.escape(p), text)]
        assert not found, f"{os.path.relpath(path, ROOT)} uses {found}; go through rllib_recorder/_rllib_compat.py"


def test_objects_holding_open_files_refuse_to_be_pickled_with_the_fix(recorded_cartpole, tmp_path):
    import pickle

    from rllib_recorder import open_run
    from rllib_recorder.format.open_columns import OpenColumns
    from rllib_recorder.format.spool_files import SegmentWriter
    from rllib_recorder.read.worker_file import WorkerFile

    with open_run(recorded_cartpole) as run:
        run.counts()  # opens the files
        for holder, fix in ((run, "rllib_recorder.open_run(path)"), (run.files[0], "WorkerFile(path)"),
                            (WorkerFile(str(tmp_path / "x.h5")), "WorkerFile(path)")):
            with pytest.raises(TypeError, match=re.escape(fix)):
                pickle.dumps(holder)
    for cls in (SegmentWriter, OpenColumns):
        with pytest.raises(TypeError, match="can't be pickled"):
            pickle.dumps(cls.__new__(cls))
