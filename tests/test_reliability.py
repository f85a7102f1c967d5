"""Faults injected for real (SIGKILL of the actual process, a full disk, damaged files), then every row checked."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import ray
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rllib_recorder import OutputDirError, RecorderCallback, RecorderError
from rllib_recorder.cli import main
from rllib_recorder.commands.verify import verify_run
from rllib_recorder.read import accounting
from rllib_recorder.read.run import open_run
from rllib_recorder.service.pool import writer_name
from tests.helpers import damage, rllib_sampled
from tests.integrity import check_run
from tests.test_recording import ppo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def _writer_actor(run_dir: str, index: int = 0):
    run_id = json.load(open(os.path.join(run_dir, "manifest.json")))["run_id"]
    return ray.get_actor(writer_name(run_id, index), namespace=ray.get_runtime_context().namespace)


def _build(config, out, **settings):
    return config.callbacks(RecorderCallback.configured(output_dir=str(out), **settings)).build_algo()


@pytest.mark.compat
@pytest.mark.slow
def test_killed_writer_is_restarted_and_loses_nothing(ray_session, tmp_path):
    algo = _build(ppo(runners=2), tmp_path, coalesce_rows=0)
    results = [algo.train()]
    run_dir = results[0]["recorder"]["run_dir"]
    writer_actor = _writer_actor(run_dir)
    old_pid = _pid_of(writer_actor)
    os.kill(old_pid, signal.SIGKILL)
    results += [algo.train() for _ in range(3)]  # training goes on while Ray restarts the writer
    new_pid = _pid_of(writer_actor)
    algo.stop()
    assert new_pid != old_pid
    sampled = rllib_sampled(results)  # RLlib's count
    counts = check_run(run_dir, sampled=sampled)  # every row, value by value: no gap, no duplicate, none missing
    with open_run(run_dir) as run:
        assert run.num_env_steps == sampled == counts["agent_steps"]
        assert run.manifest["totals"]["unacked_at_stop"] == 0
    assert verify_run(run_dir) == []


def _session_pids(sid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) == sid:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True,
                             text=True)
    if mounted.returncode:  # never skipped: CI runs as root (.ci/run), where it mounts
        pytest.fail(f"the full-disk test needs a 4 MB tmpfs and could not mount one ({mounted.stderr.strip()}): "
                    "run the suite as root, as .ci/run does")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_full_disk_reaches_the_driver_as_one_clear_error_and_keeps_earlier_rows(ray_session, small_disk):
    config = ppo(obs_kind="image", runners=1).training(train_batch_size=400)
    algo = _build(config, small_disk, coalesce_rows=0, compression="none", hdf5_chunk_bytes=1 << 16,
                  fail_on_error=True)
    results, raised = [], None
    for _ in range(15):
        try:
            results.append(algo.train())
        except RecorderError as e:  # fail_on_error=True: the first result after the error raises
            raised = e
            break
    # RLlib's count, of the iteration that raised too (its result never came back; the algorithm holds it)
    rllib = int(algo.metrics.peek(("env_runners", "num_env_steps_sampled_lifetime")))
    assert raised is not None, "the disk never filled"
    message = str(raised)
    assert "disk full" in message and "free space" in message and "\n" not in message
    assert "fail_on_error=True" in message
    # The env runner survived the refused chunks and still samples; it counted them.
    from rllib_recorder.record.runner import recorder_for

    def sample_and_count(runner):
        steps = sum(len(e) for e in runner.sample())
        return steps, recorder_for(runner).stats()

    (steps, stats), = algo.env_runner_group.foreach_env_runner(sample_and_count, local_env_runner=False)
    assert steps > 0 and stats["chunks_failed"] >= 1
    # sampled outside train(): RLlib's count does not hold it, and the disk may be too full for the runner's count of
    # its loss to reach the file: stored plus named is RLlib's count, plus at most those steps
    rllib = (rllib, rllib + steps)
    run_dir = next(base for base, _, names in os.walk(small_disk) if "manifest.json" in names)
    algo.stop()
    for _ in range(30):  # the writer that could not close its file is killed by algo.stop(), asynchronously
        try:
            with open_run(run_dir) as run:  # what the recorder names as not stored: by cause where the full disk
                runs = accounting.accounts(run.manifest, run.files)  # let its counters in, else by RLlib's count
                named = sum(sum(a.lost.values()) for a in runs) + accounting.unexplained_steps(run.manifest, runs)
            # earlier rows intact; every step RLlib sampled is stored, or among those the recorder named
            counts = check_run(run_dir, "image", statuses=("running", "finished"), allow_gaps=True,
                               sampled=rllib, not_stored=named)
            break
        except RecorderError as e:
            assert "unable to lock file" in str(e)
            time.sleep(0.5)
    assert counts["agent_steps"] > 0 and named > 0
    with open_run(run_dir) as run:
        assert run.num_env_steps == counts["agent_steps"]
    assert not [n for n in os.listdir(run_dir) if n.endswith(".rewrite-tmp")]  # no half-made compaction left


def _snapshot(root) -> dict[str, tuple[str, int]]:
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            out[path] = (hashlib.sha256(open(path, "rb").read()).hexdigest(), os.stat(path).st_mtime_ns)
    return out


def test_existing_run_and_readonly_dir_are_refused_before_training_untouched(ray_session, recorded_cartpole, tmp_path):
    output_dir, name = os.path.split(recorded_cartpole)
    before = _snapshot(output_dir)
    config = ppo(runners=0).callbacks(RecorderCallback.configured(output_dir=output_dir, run_name=name))
    with pytest.raises(OutputDirError, match="already holds a run; choose another run_name"):
        config.build_algo()
    assert _snapshot(output_dir) == before  # not one byte, not one mtime changed
    readonly = tmp_path / "ro"
    readonly.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)]).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (root ignores file permissions)")
    try:
        with pytest.raises(OutputDirError, match="is not writable.*output_dir="):
            RecorderCallback.configured(output_dir=str(readonly / "runs"))
    finally:
        subprocess.run(["umount", "-l", str(readonly)], check=False)


@pytest.fixture(scope="module")
def undamaged_run(recorded_cartpole, tmp_path_factory):
    """A run whose worker file has the same bytes in every test session (fixed rows, no compression), so the
    derandomized mutations below hit the same places each time: HDF5 can loop forever on some damaged files
    (docs/RELIABILITY.md, Not done), and a random recorded file made that a lottery."""
    run_dir = str(tmp_path_factory.mktemp("undamaged") / "run")
    _fixed_run(recorded_cartpole, run_dir)
    return run_dir


def _fixed_run(template: str, run_dir: str) -> str:
    """``template``'s manifest with one worker file of fixed rows, written and closed by a writer here; its path."""
    from rllib_recorder.format import datasets
    from rllib_recorder.record.convert import episodes_to_chunk
    from rllib_recorder.service.writer import RecordingWriter
    from tests.helpers import make_episode

    shutil.copytree(template, run_dir)
    for name in os.listdir(run_dir):
        if name.endswith(".h5"):
            os.remove(os.path.join(run_dir, name))
    run_id = json.load(open(os.path.join(run_dir, "manifest.json")))["run_id"]
    writer = RecordingWriter(run_dir, run_id, datasets.StorageOptions(compression="none"))
    for seq in range(12):
        episode = make_episode(20, t_started=20 * (seq % 3), eps_id=f"episode-{seq // 3:04d}", terminated=seq % 3 == 2)
        writer.append(1, False, b"d" * 32, seq, episodes_to_chunk([episode], sampled_at_s=1.0e9 + seq))
    writer.close()
    return os.path.join(run_dir, "worker-001.h5")


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["flip", "truncate", "random", "zero"]), where=st.floats(0, 1),
       size=st.integers(1, 64), seed=st.integers(0, 2**31))
def test_damaged_files_give_one_line_errors_never_tracebacks(undamaged_run, tmp_path_factory, kind, where,
                                                              size, seed):
    import random

    data = open(os.path.join(undamaged_run, "worker-001.h5"), "rb").read()
    _answers_damage_in_one_line(undamaged_run, tmp_path_factory,
                                damage(data, kind, int(where * (len(data) - 1)), size, random.Random(seed)))


# Found in a full run: damage in a root attribute and in a column's name. Aimed by what the bytes hold (names HDF5
# keeps as text in object headers and heaps), so that a change of layout moves the aim with it.
@pytest.mark.parametrize("name", [b"schema_version", b"commit", b"rewards", b"terminateds"])
def test_a_damaged_attribute_or_column_name_gives_one_line_errors(undamaged_run, tmp_path_factory, name):
    import random

    data = open(os.path.join(undamaged_run, "worker-001.h5"), "rb").read()
    at = data.find(name)
    assert at > 0, f"{name!r} is no longer in the file's bytes: aim this test at what the file holds now"
    _answers_damage_in_one_line(undamaged_run, tmp_path_factory, damage(data, "flip", at, 3, random.Random(0)))


def _answers_damage_in_one_line(undamaged_run, tmp_path_factory, damaged: bytes) -> None:
    """Every command gives data or one 'error:' line on a copy of the run whose worker file is ``damaged``; the
    reader API gives data or the project's one-line error."""
    run_dir = str(tmp_path_factory.mktemp("damaged") / "run")
    shutil.copytree(undamaged_run, run_dir)
    open(os.path.join(run_dir, "worker-001.h5"), "wb").write(damaged)
    for command in (["info", run_dir], ["verify", run_dir], ["recover", run_dir], ["verify", run_dir]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code in (0, 1, 2), (command, result.output, result.exception)
        assert "Traceback" not in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        if result.exit_code == 2:
            lines = result.output.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    try:  # the reader API: the project's error or data
        with open_run(run_dir) as run:
            sum(len(e) for e in run.episodes())
    except RecorderError as e:
        assert "\n" not in str(e)


def test_a_file_hdf5_loops_on_gives_a_one_line_error_not_a_hang(undamaged_run, tmp_path, monkeypatch):
    """64 zero bytes at offset 2048 of the worker file damage its chunk index so that HDF5 loops forever
    (checked below with probing off); every command and the reader answer with a one-line error instead."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(undamaged_run, run_dir)
    path = os.path.join(run_dir, "worker-001.h5")
    with open(path, "r+b") as f:
        f.seek(2048)
        f.write(bytes(64))
    _hdf5_spins_on(run_dir)  # the damage is real: unprobed, HDF5 never returns

    monkeypatch.setenv("RLLIB_RECORDER_PROBE_TIMEOUT_S", "1")
    for command in ([c, run_dir] for c in ("info", "verify", "recover", "replay")):
        result = CliRunner().invoke(main, command)  # ended by the probe's timeout (pytest's ends a hang)
        assert result.exit_code == 2, (command, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "worker-001.h5 is damaged: HDF5 made no progress" in lines[0], result.output
    with pytest.raises(RecorderError, match="made no progress reading its structure for 1 s"):
        with open_run(run_dir) as run:
            sum(len(e) for e in run.episodes())
    assert open(path, "rb").read(2112)[2048:] == bytes(64)  # nothing rewrote or removed the file


# The child imports everything first, says so, then reads the run unprobed: what it burns after that is HDF5's.
_SPIN_CHILD = """
import sys
from rllib_recorder.cli import main
import rllib_recorder.commands.info, rllib_recorder.read.run, rllib_recorder.format.h5file
print("inside", flush=True)
main(["info", sys.argv[1]])
print("returned", flush=True)
"""


def _hdf5_spins_on(run_dir: str, cpu_s: float = 3.0) -> None:
    """Shows that HDF5, reading ``run_dir`` unprobed, never returns: the child reads its line 'inside' once it has
    imported everything and enters the read, then burns ``cpu_s`` of CPU time without returning (a slow start on a
    loaded machine burns no CPU of the child's after 'inside'; a read that returns prints 'returned')."""
    env = {**os.environ, "RLLIB_RECORDER_PROBE": "0"}
    child = subprocess.Popen([sys.executable, "-c", _SPIN_CHILD, run_dir], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert child.stdout.readline().strip() == "inside"
        start = _cpu_s(child.pid)
        while _cpu_s(child.pid) - start < cpu_s:
            assert child.poll() is None, f"HDF5 returned: {child.stdout.read()}"
            time.sleep(0.1)
    finally:
        child.kill()
        child.wait()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def probes(monkeypatch):
    """The paths this process's probe child is asked about (none remembered as passed before the test)."""
    from rllib_recorder.format import probe

    asked = []
    real = probe._PROBER.probe
    monkeypatch.setattr(probe, "_passed", {})
    monkeypatch.setattr(probe._PROBER, "probe", lambda path, timeout_s: asked.append(path) or real(path, timeout_s))
    return asked


def test_a_file_its_writer_closed_is_read_unprobed_and_damage_after_that_is_still_probed(recorded_cartpole, tmp_path,
                                                                                         probes, monkeypatch):
    """A fresh process starts no probe child for a file its writer closed cleanly here (format/sound_files.py);
    bytes changed after that, even with the file's size and mtime put back as a copy tool keeps them, are probed:
    the damage that makes HDF5 loop is still one line, never a hang."""
    from rllib_recorder.format import sound_files

    run_dir = str(tmp_path / "run")
    path = _fixed_run(recorded_cartpole, run_dir)
    assert sound_files.known_sound(path)
    with open_run(run_dir) as run:
        assert run.counts()["agent_steps"] == 240
    assert probes == []
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(2048)
        f.write(bytes(64))  # the loop of test_a_file_hdf5_loops_on_gives_a_one_line_error_not_a_hang
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    assert not sound_files.known_sound(path)
    monkeypatch.setenv("RLLIB_RECORDER_PROBE_TIMEOUT_S", "1")
    result = CliRunner().invoke(main, ["info", run_dir])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "worker-001.h5 is damaged: HDF5 made no progress" in result.output
    assert probes == [path]


def test_a_recorded_run_is_read_in_a_fresh_process_without_a_probe(recorded_cartpole, probes):
    """Its writer actor closed its files cleanly at algo.stop(): they are known sound on this machine."""
    with open_run(recorded_cartpole) as run:
        assert run.counts()["env_steps"] > 0
    assert probes == []


def test_a_copy_is_probed_once_then_known_and_a_file_reopened_by_another_writer_is_not_vouched_for(
        recorded_cartpole, tmp_path, probes):
    from rllib_recorder.format import datasets, probe, sound_files
    from rllib_recorder.record.convert import episodes_to_chunk
    from rllib_recorder.service.writer import RecordingWriter
    from tests.helpers import make_episode

    path = _fixed_run(recorded_cartpole, str(tmp_path / "run"))
    copy = str(tmp_path / "copy")
    shutil.copytree(tmp_path / "run", copy)  # times kept, a new inode: a copied or downloaded run
    with open_run(copy) as run:
        run.counts()
    assert probes == [os.path.join(copy, "worker-001.h5")]
    probe._passed.clear()  # as a fresh process
    with open_run(copy) as run:
        run.counts()
    assert len(probes) == 1  # remembered after its probe passed

    writer = RecordingWriter(str(tmp_path / "run"), _run_id(tmp_path / "run"), datasets.StorageOptions())
    writer.append(1, False, b"e" * 32, 0, episodes_to_chunk([make_episode(5, eps_id="later")], sampled_at_s=2.0e9))
    writer.close()  # a Tune retry's writer appending to the file an earlier process wrote (maybe killed)
    assert not sound_files.known_sound(path)


def test_a_fifo_named_like_a_worker_file_is_never_known_sound_and_never_opened_here(tmp_path):
    from rllib_recorder.format import sound_files

    os.mkfifo(tmp_path / "worker-001.h5")  # opening it to read would wait for a writer forever
    sound_files.remember(str(tmp_path / "worker-001.h5"))
    assert not sound_files.known_sound(str(tmp_path / "worker-001.h5"))


def _run_id(run_dir) -> str:
    return json.load(open(os.path.join(run_dir, "manifest.json")))["run_id"]


def test_where_no_record_can_be_kept_every_file_is_probed_as_before(recorded_cartpole, tmp_path, probes, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("RLLIB_RECORDER_SOUND_DIR", str(blocked / "sound"))  # can't be made
    path = _fixed_run(recorded_cartpole, str(tmp_path / "run"))
    with open_run(str(tmp_path / "run")) as run:
        run.counts()
    assert probes == [path]
