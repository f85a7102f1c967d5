"""The spool between env runner and writer: the record codec, and the writer's ingest (coalescing, time-bounded
commits, restarts, failures), with real files, a fake clock and no threads; then once through a real writer actor."""

import json
import os
import struct
import zlib

import h5py
import numpy as np
import pytest

from rllib_recorder import RecorderConfig
from rllib_recorder.errors import SchemaError
from rllib_recorder.format.spool import HEADER, KIND_CHUNK, MAGIC, encode_record, read_record
from rllib_recorder.format.spool_files import SPOOL_DIR, SegmentWriter, segments_of
from rllib_recorder.read.run import open_run
from rllib_recorder.record.convert import episodes_to_chunk
from rllib_recorder.record.outbox import Outbox
from rllib_recorder.service.pool import SpoolWriter, tick_s
from tests.helpers import make_episode


class Clock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def sample(n, t, eps="e0", at=1000.0, version=3, terminated=False):
    return episodes_to_chunk([make_episode(n, t_started=t, eps_id=eps, version=version, terminated=terminated)],
                             sampled_at_s=at)


def runner(run_dir, stem="worker-001", sender=None, **kwargs):
    directory = os.path.join(run_dir, SPOOL_DIR, stem, sender or os.urandom(16).hex())
    return Outbox(SegmentWriter(directory, segment_bytes=kwargs.pop("segment_bytes", 16 << 20)), **kwargs)


def writer(run_dir, clock, **settings):
    config = RecorderConfig(output_dir=os.path.dirname(run_dir), **settings)
    return SpoolWriter(run_dir, "run-1", config, "", 0, clock=clock, thread=False)


def stored_obs(run_dir, stem="worker-001"):
    path = os.path.join(run_dir, f"{stem}.h5")
    if not os.path.exists(path):
        return np.zeros(0)
    with h5py.File(path, "r", locking=False) as h5:  # as the writer opens it
        commit = json.loads(h5.attrs["commit"])
        rows = commit["agents"].get("default_agent", (0, 0))[0]
        return h5["agents/default_agent/steps/obs"][:rows, 0] if rows else np.zeros(0)


def batches(run_dir, stem="worker-001"):
    with h5py.File(os.path.join(run_dir, f"{stem}.h5"), "r", locking=False) as h5:
        n = json.loads(h5.attrs["commit"])["batches"]
        return {k: v[:n] for k, v in h5["batches"].items()}


# -------------------------------------------------------------------------------------------- the codec


def _one_record(tmp_path, buffers):
    path = tmp_path / "seg.spool"
    path.write_bytes(b"".join(bytes(b) for b in buffers))
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_record(fd, 0, os.path.getsize(path), str(path))
    finally:
        os.close(fd)


def test_a_record_rebuilds_every_column_kind_exactly(tmp_path):
    chunk = episodes_to_chunk([make_episode(4, eps_id="a" * 36), make_episode(3, eps_id="b", terminated=True)],
                              sampled_at_s=12.5)
    record = _one_record(tmp_path, encode_record(KIND_CHUNK, 7, {"sender": "s"}, chunk))
    assert (record.kind, record.seq, record.meta) == (KIND_CHUNK, 7, {"sender": "s"})
    got, sent = record.chunk.streams["default_agent"], chunk.streams["default_agent"]
    assert (record.chunk.env_steps, record.chunk.sampled_at_s) == (7, 12.5)
    for table in ("steps", "fragments"):
        assert getattr(got, table).keys() == getattr(sent, table).keys()
        for path, values in getattr(sent, table).items():
            out = getattr(got, table)[path]
            if values.dtype == object:
                assert [v.tobytes() if isinstance(v, np.ndarray) else v for v in out] == [
                    v.tobytes() if isinstance(v, np.ndarray) else v for v in values], path
            else:
                assert out.dtype == values.dtype and np.array_equal(out, values), path


@pytest.mark.parametrize("damage, message", [
    (lambda b: b"XXXX" + b[4:], "no spool record"),
    (lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], "fails its checksum"),
    (lambda b: b[:6] + b"\xff\x00" + b[8:], "kind"),
    (lambda b: b[:8] + b"\xff" * 8 + b[16:], "fails its checksum"),
])
def test_bytes_that_are_not_a_record_give_one_line_errors(tmp_path, damage, message):
    data = b"".join(bytes(b) for b in encode_record(KIND_CHUNK, 0, {}, sample(3, 0)))
    with pytest.raises(SchemaError, match=message) as raised:
        _one_record(tmp_path, [damage(data)])
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("meta", [
    {"chunk": {"env_steps": 1, "num_samples": 1, "sampled_at_s": 0, "streams": {"a": {"columns": [
        {"t": "steps", "p": "rewards", "k": "a", "d": "|O", "s": [1], "o": 0, "n": 8}]}}}},
    {"chunk": {"env_steps": 1, "num_samples": 1, "sampled_at_s": 0, "streams": {"../../x": {"columns": []}}}},
    {"chunk": {"env_steps": 1, "num_samples": 1, "sampled_at_s": 0, "streams": {"a": {"columns": [
        {"t": "steps", "p": "rewards", "k": "a", "d": "<f8", "s": [10 ** 9], "o": 0, "n": 8}]}}}},
    {"chunk": {"env_steps": 1, "num_samples": 1, "sampled_at_s": 0, "streams": {"a": {"columns": [
        {"t": "steps", "p": "/abs", "k": "a", "d": "<f8", "s": [1], "o": 0, "n": 8}]}}}},
    {"chunk": []},
])
def test_a_hostile_record_is_refused_and_nothing_in_it_is_executed(tmp_path, meta):
    meta_bytes, data = json.dumps(meta).encode(), bytes(16)
    crc = zlib.crc32(meta_bytes + data, zlib.crc32(HEADER.pack(MAGIC, 1, KIND_CHUNK, 0, len(meta_bytes), len(data), 0)))
    header = HEADER.pack(MAGIC, 1, KIND_CHUNK, 0, len(meta_bytes), len(data), crc)
    with pytest.raises(SchemaError, match="malformed"):
        _one_record(tmp_path, [header, meta_bytes, data])


def test_a_record_cut_short_is_not_read_until_it_is_whole(tmp_path):
    data = b"".join(bytes(b) for b in encode_record(KIND_CHUNK, 0, {}, sample(3, 0)))
    for cut in (0, 10, HEADER.size, len(data) - 1):
        assert _one_record(tmp_path, [data[:cut]]) is None
    assert _one_record(tmp_path, [data]).chunk.agent_steps == 3


# -------------------------------------------------------------------------------------------- the ingest


def test_small_samples_are_committed_together_once_enough_rows_wait(tmp_path):
    run_dir, clock = str(tmp_path / "run"), Clock()
    out, spool = runner(run_dir), writer(run_dir, clock, coalesce_rows=10, coalesce_s=60)
    for i in range(4):
        out.add(sample(3, 3 * i, at=clock.now))
    spool.poll()
    assert stored_obs(run_dir).tolist() == list(range(12))  # 4 samples of 3 rows: one commit at 12 >= 10
    index = batches(run_dir)
    assert index["seq"].tolist() == [0] and index["num_samples"].tolist() == [4]
    assert index["sender_env_steps_sampled"].tolist() == [-1]  # this outbox has no sampled counter


def test_verify_reads_coalesced_batches_as_contiguous_samples(tmp_path):
    from rllib_recorder.commands.verify import _verify_file
    from rllib_recorder.read.worker_file import WorkerFile

    run_dir, clock = str(tmp_path / "run"), Clock()
    out, spool = runner(run_dir), writer(run_dir, clock, coalesce_rows=10, coalesce_s=60)
    for i in range(8):  # two commits of four samples each: seq 0 and 4
        out.add(sample(3, 3 * i, at=clock.now))
        spool.poll()
    spool.close()
    assert batches(run_dir)["seq"].tolist() == [0, 4]
    assert _verify_file(WorkerFile(os.path.join(run_dir, "worker-001.h5"))) == []


def test_a_lone_sample_is_committed_within_coalesce_s_without_another_sample_following(tmp_path):
    run_dir, clock = str(tmp_path / "run"), Clock()
    out, spool = runner(run_dir), writer(run_dir, clock, coalesce_rows=4096, coalesce_s=2.0)
    out.add(sample(5, 0, at=clock.now))
    spool.poll()
    assert len(stored_obs(run_dir)) == 0  # waits for company
    clock.now += 2.0 - spool.tick_s  # the last tick before it would have waited 2 s
    spool.poll()
    assert stored_obs(run_dir).tolist() == [0, 1, 2, 3, 4]
    assert not [i for i in segments_of(out.segments.directory)[:-1]]


def test_another_policy_version_or_sender_is_never_coalesced_with_what_waits(tmp_path):
    run_dir, clock = str(tmp_path / "run"), Clock()
    first, second = runner(run_dir), runner(run_dir)
    spool = writer(run_dir, clock, coalesce_rows=1000, coalesce_s=60)
    first.add(sample(2, 0, eps="a", version=1))
    first.add(sample(2, 2, eps="a", version=2))
    spool.poll()
    second.add(sample(3, 0, eps="b", version=2))
    spool.poll()
    spool.close()
    index = batches(run_dir)
    assert index["weights_seq_no_min"].tolist() == [1, 2, 2]
    assert sorted(set(index["sender_id"].tolist())) == sorted([first.sender_id.encode(), second.sender_id.encode()])


def test_a_restarted_writer_commits_the_rest_once_and_deletes_what_is_committed(tmp_path):
    run_dir, clock = str(tmp_path / "run"), Clock()
    out = runner(run_dir, segment_bytes=2048)
    spool = writer(run_dir, clock, coalesce_rows=10, coalesce_s=60)
    for i in range(6):
        out.add(sample(5, 5 * i, at=clock.now))
    spool.poll()  # 30 rows: three commits of 10
    assert len(stored_obs(run_dir)) == 30
    for i in range(6, 9):
        out.add(sample(5, 5 * i, at=clock.now))
    del spool  # killed: what it had read and not committed is only in the spool
    again = writer(run_dir, clock, coalesce_rows=10, coalesce_s=60)
    again.poll()
    out.close()
    stats = again.close()
    assert stored_obs(run_dir).tolist() == list(range(45))  # every row once, in order
    index = batches(run_dir)
    assert index["seq"].tolist() == [0, 2, 4, 6, 8] and index["num_samples"].tolist() == [2, 2, 2, 2, 1]
    assert stats["spool_leftovers"] == {} and not os.path.exists(os.path.join(run_dir, SPOOL_DIR))
    assert stats["env_steps"] == 45  # totals rebuilt from the file after the restart


def test_a_failing_commit_keeps_the_samples_in_the_spool_counts_one_error_and_retries(tmp_path, monkeypatch):
    run_dir, clock = str(tmp_path / "run"), Clock()
    out, spool = runner(run_dir), writer(run_dir, clock, coalesce_rows=0)
    real_append = spool.writer.append
    failing = {"on": True}

    def append(*args, **kwargs):
        if failing["on"]:
            raise OSError(28, "No space left on device")
        return real_append(*args, **kwargs)

    monkeypatch.setattr(spool.writer, "append", append)
    out.add(sample(4, 0))
    for _ in range(3):
        spool.poll()
        clock.now += 1
    stats = spool.stats()
    assert stats["errors"] == 1 and "No space left" in stats["last_error"]
    assert len(stored_obs(run_dir)) == 0 and segments_of(out.segments.directory)
    failing["on"] = False
    clock.now += 10
    spool.poll()
    assert stored_obs(run_dir).tolist() == [0, 1, 2, 3]


def test_a_runner_killed_inside_a_write_leaves_a_cut_record_that_is_never_stored(tmp_path):
    run_dir, clock = str(tmp_path / "run"), Clock()
    out = runner(run_dir)
    out.add(sample(3, 0))
    whole = b"".join(bytes(b) for b in encode_record(KIND_CHUNK, 1, {}, sample(2, 3)))
    path = os.path.join(out.segments.directory, "000000.spool")
    with open(path, "ab") as f:
        f.write(whole[: len(whole) // 2])
    spool = writer(run_dir, clock, coalesce_rows=0)
    spool.poll()
    stats = spool.close()
    assert stored_obs(run_dir).tolist() == [0, 1, 2]
    assert stats["spool_leftovers"] == {}  # not a loss: that sample() had not returned


def test_a_damaged_spool_stores_what_came_before_and_is_named(tmp_path):
    run_dir, clock = str(tmp_path / "run"), Clock()
    out = runner(run_dir)
    out.add(sample(3, 0))
    with open(os.path.join(out.segments.directory, "000000.spool"), "ab") as f:
        f.write(struct.pack("<4sHHQIQI", b"JUNK", 1, 1, 0, 0, 0, 0) + bytes(64))
    spool = writer(run_dir, clock, coalesce_rows=0)
    spool.poll()
    stats = spool.close()
    assert stored_obs(run_dir).tolist() == [0, 1, 2]
    (why,) = stats["spool_leftovers"].values()
    assert "damaged spool" in why and "no spool record" in why


def test_a_writer_actor_reads_the_spool_on_its_own_and_commits_at_its_coalescing_deadline(ray_session, tmp_path):
    """Nothing calls the actor after the sample is spooled: the rows become visible on their own, before the
    outbox closes, and the writer's own timestamps say it committed them at coalesce_s after they were sampled
    (at its last tick before that), not before (5 rows, far under coalesce_rows)."""
    import time

    import ray

    run_dir = str(tmp_path / "run")
    config = RecorderConfig(output_dir=str(tmp_path), coalesce_s=0.5)
    actor = ray.remote(SpoolWriter).options(num_cpus=0).remote(run_dir, "run-1", config, "", 0)
    try:
        ray.get(actor.stats.remote())
        out = runner(run_dir)
        out.add(sample(5, 0, at=time.time()))
        while True:  # until committed (pytest's timeout ends a writer that never commits)
            try:
                if len(stored_obs(run_dir)) == 5:
                    break
            except OSError:  # caught mid-commit (reading live files safely is the reader's business)
                pass
            time.sleep(0.02)
        out.close()
        stats = ray.get(actor.close.remote())
    finally:
        ray.kill(actor)
    assert stored_obs(run_dir).tolist() == [0, 1, 2, 3, 4]
    with h5py.File(os.path.join(run_dir, "worker-001.h5"), "r") as h5:
        sampled_at, written_at = (h5[f"batches/{name}"][0] for name in ("sampled_at_s", "written_at_s"))
    # held for the deadline (the writer commits at its last tick before it), then committed unasked
    assert written_at >= sampled_at + config.coalesce_s - tick_s(config.coalesce_s)
    assert stats["spool_leftovers"] == {} and stats["env_steps"] == 5
    with open_run_dir(run_dir) as run:
        assert run.num_env_steps == 5


def open_run_dir(run_dir):
    from rllib_recorder.format.layout import SCHEMA_VERSION
    from rllib_recorder.format.manifest import write_manifest

    write_manifest(run_dir, {"format": "rllib_recorder", "schema_version": SCHEMA_VERSION, "status": "finished",
                             "run_id": "run-1"})
    return open_run(run_dir)


def _counting_runner(run_dir, **kwargs):
    """An outbox whose runner counts what it sampled, as EnvRunnerRecorder does (sampled before anything can fail)."""
    sampled = {"env_steps_sampled": 0}
    out = runner(run_dir, extra_stats=lambda: dict(sampled), **kwargs)

    def add(chunk):
        sampled["env_steps_sampled"] += chunk.env_steps
        out.add(chunk)
    return out, add


def _finish(run_dir, spool, totals=None):
    from rllib_recorder.format.manifest import write_manifest

    stats = spool.close()
    write_manifest(run_dir, {"format": "rllib_recorder", "schema_version": "2.1", "status": "finished",
                             "totals": totals(stats) if totals else {}})
    return stats


def test_verify_names_backpressure_drops_by_cause_and_counts_every_sampled_step(tmp_path):
    from rllib_recorder.commands.verify import verify_report

    run_dir, clock = str(tmp_path / "run"), Clock()
    out, add = _counting_runner(run_dir, policy="drop", max_backlog_bytes=1)  # the second sample finds it full
    spool = writer(run_dir, clock, coalesce_rows=0)
    for i in range(4):
        add(sample(5, 5 * i, at=clock.now))
        spool.poll()
    out.close()
    _finish(run_dir, spool, lambda stats: {"senders": stats["runners"]})
    report = verify_report(run_dir)
    assert report["problems"] == [], report
    assert report["summary"].startswith("5 of 20 sampled env steps stored"), report
    note, = report["notes"]
    assert "15 of 20 sampled env steps not stored: dropped by back-pressure" in note
    assert "backpressure='drop': 15 steps" in note


def test_verify_finds_a_gap_from_the_file_alone_when_the_manifest_has_no_totals(tmp_path):
    """A driver killed before it wrote totals: the batch rows' sender counters still show what was sampled."""
    from rllib_recorder.commands.verify import verify_report

    run_dir, clock = str(tmp_path / "run"), Clock()
    out, add = _counting_runner(run_dir)
    spool = writer(run_dir, clock, coalesce_rows=0)
    add(sample(5, 0, at=clock.now))
    spool.poll()
    _finish(run_dir, spool)
    assert verify_report(run_dir)["summary"] == "all 5 sampled env steps stored (1 env runner incarnation(s))"
    with h5py.File(os.path.join(run_dir, "worker-001.h5"), "a", locking=False) as h5:  # as if 3 had been lost
        h5["batches/sender_env_steps_sampled"][0] = 8
    problems = verify_report(run_dir)["problems"]
    assert len(problems) == 1 and "3 of 8 sampled env steps are neither stored nor counted as lost" in problems[0]
