"""Flow control in the env runner: real spool files in a temp dir, a fake clock: milliseconds, no Ray, no sleeping."""

import os

import numpy as np

from rllib_recorder.format.spool import KIND_CHUNK, KIND_END, KIND_STATS, read_record
from rllib_recorder.format.spool_files import SegmentWriter, segments_of
from rllib_recorder.record.convert import ConvertOptions, episodes_to_chunk
from rllib_recorder.record.outbox import WRITER_STALE_S, Outbox
from tests.helpers import image_episode, make_episode


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def records(directory):
    """Every complete record in a sender's spool, in order."""
    out = []
    for index in segments_of(directory):
        path = os.path.join(directory, f"{index:06d}.spool")
        fd = os.open(path, os.O_RDONLY)
        try:
            offset, size = 0, os.path.getsize(path)
            while (record := read_record(fd, offset, size, path)) is not None:
                out.append(record)
                offset = record.end
        finally:
            os.close(fd)
    return out


def make(tmp_path, heartbeat=lambda: None, **kwargs):
    clock = FakeClock()
    segments = SegmentWriter(str(tmp_path / "spool"), segment_bytes=kwargs.pop("segment_bytes", 16 << 20))
    outbox = Outbox(segments, clock=clock, sleep=clock.sleep, writer_heartbeat_s=heartbeat, **kwargs)
    return outbox, segments, clock


def chunk(n=2, t=0, eps="e"):
    return episodes_to_chunk([make_episode(n, t_started=t, eps_id=eps)], sampled_at_s=float(t))


def test_every_sample_is_in_the_spool_when_add_returns_numbered_with_its_counters(tmp_path):
    outbox, segments, _ = make(tmp_path)
    outbox.add(chunk(3))
    outbox.add(chunk(2, t=3))
    got = records(segments.directory)  # read by another file descriptor: it has left this object
    assert [(r.kind, r.seq) for r in got] == [(KIND_CHUNK, 0), (KIND_CHUNK, 1)]
    assert [r.chunk.agent_steps for r in got] == [3, 2]
    np.testing.assert_array_equal(got[1].chunk.streams["default_agent"].steps["obs"][:, 0], [3, 4])
    assert got[1].meta["stats"]["chunks_written"] == 2 and got[1].meta["stats"]["env_steps_written"] == 5
    assert got[0].meta["sender"] == outbox.sender_id
    assert outbox.stats.chunks_written == 2 and outbox.stats.rows_written == 5


def test_report_and_close_write_counters_alone_and_close_is_final(tmp_path):
    outbox, segments, _ = make(tmp_path)
    outbox.add(chunk())
    outbox.report()
    stats = outbox.close()
    outbox.close()  # idempotent
    assert [r.kind for r in records(segments.directory)] == [KIND_CHUNK, KIND_STATS, KIND_END]
    assert stats["chunks_written"] == 1 and outbox.closed


def test_segments_rotate_and_the_backlog_counts_what_the_writer_has_not_deleted(tmp_path):
    outbox, segments, _ = make(tmp_path, segment_bytes=4096)
    for i in range(12):
        outbox.add(chunk(20, t=20 * i))
    names = segments_of(segments.directory)
    assert len(names) > 2
    total = segments.backlog_bytes()
    assert total == sum(os.path.getsize(os.path.join(segments.directory, f"{i:06d}.spool")) for i in names)
    os.remove(os.path.join(segments.directory, f"{names[0]:06d}.spool"))  # the writer committed it
    assert segments.backlog_bytes() < total
    assert [r.seq for r in records(segments.directory)] == list(range(12))[-len(records(segments.directory)):]


def test_full_backlog_blocks_until_the_writer_deletes_and_counts_the_wait(tmp_path):
    outbox, segments, clock = make(tmp_path, segment_bytes=2048, max_backlog_bytes=6000)
    while segments.backlog_bytes() < 6000:
        outbox.add(chunk(10))
    waits = []

    def writer_catches_up(seconds):
        clock.now += seconds
        waits.append(seconds)
        if clock.now >= 0.5:  # the writer commits and deletes the old segments
            for index in segments_of(segments.directory)[:-1]:
                os.remove(os.path.join(segments.directory, f"{index:06d}.spool"))

    outbox.sleep = writer_catches_up
    before = outbox.stats.chunks_written
    outbox.add(chunk(10))
    assert outbox.stats.chunks_written == before + 1 and outbox.stats.chunks_dropped == 0
    assert 0.5 <= outbox.stats.wait_s < 0.6 and outbox.stats.max_wait_s == outbox.stats.wait_s


def test_drop_policy_drops_and_counts_by_cause_without_waiting(tmp_path):
    outbox, segments, clock = make(tmp_path, segment_bytes=2048, max_backlog_bytes=4000, policy="drop")
    while segments.backlog_bytes() < 4000:
        outbox.add(chunk(10))
    written = outbox.stats.chunks_written
    outbox.add(chunk(7))
    assert clock.now == 0 and outbox.stats.chunks_written == written
    assert outbox.stats.chunks_dropped == 1 and outbox.stats.env_steps_dropped == 7
    assert dict(outbox.stats.drop_causes) == {"backpressure_drop": 7}
    assert len(records(segments.directory)) == written  # nothing of the dropped sample was written


def test_block_gives_up_after_max_wait_and_names_the_drop(tmp_path):
    outbox, segments, clock = make(tmp_path, segment_bytes=2048, max_backlog_bytes=4000, max_wait_s=3.0)
    while segments.backlog_bytes() < 4000:
        outbox.add(chunk(10))
    outbox.add(chunk(4))
    assert 3.0 <= clock.now < 3.1
    assert dict(outbox.stats.drop_causes) == {"block_timeout": 4} and outbox.stats.wait_s >= 3.0


def test_a_blocked_sampler_stops_waiting_for_a_writer_whose_heartbeat_stopped(tmp_path):
    outbox, segments, clock = make(tmp_path, heartbeat=lambda: WRITER_STALE_S + 1, segment_bytes=2048,
                                   max_backlog_bytes=4000, max_wait_s=120.0)
    while segments.backlog_bytes() < 4000:
        outbox.add(chunk(10))
    outbox.add(chunk(5))
    assert clock.now < 0.1  # not two minutes
    assert dict(outbox.stats.drop_causes) == {"writer_not_consuming": 5}


def test_a_sample_the_spool_cannot_take_is_counted_as_failed_and_the_next_one_is_written(tmp_path):
    outbox, segments, _ = make(tmp_path)
    bad = chunk(3)
    bad.streams["default_agent"].fragments["infos"] = np.array([{"not": "a string"}], dtype=object)
    outbox.add(bad)
    outbox.add(chunk(2))
    assert outbox.stats.chunks_failed == 1 and outbox.stats.env_steps_failed == 3
    assert "only str and bytes can be spooled" in outbox.stats.last_error
    assert [r.seq for r in records(segments.directory)] == [0]  # seqs number what was written


def test_frames_are_written_as_uint8_codes(tmp_path):
    rng = np.random.default_rng(3)
    outbox, segments, _ = make(tmp_path, encode=True)
    episode, frames = image_episode(rng.integers(0, 256, size=(4, 6, 6, 1)), "e0")
    outbox.add(episodes_to_chunk([episode]))
    (record,) = records(segments.directory)
    stream = record.chunk.streams["default_agent"]
    assert stream.steps["obs"].dtype == np.uint8 and stream.encoded["steps/obs"] == (1 / 128, -1.0)
    np.testing.assert_array_equal(stream.steps["obs"].astype(np.float32) / 128 - 1, frames[:-1])


def test_stacked_frames_keep_their_stack_through_the_spool(tmp_path):
    from tests.helpers import stacked_frames

    rng = np.random.default_rng(5)
    options = ConvertOptions(encode_images=True, stack_frames=True)
    sample = episodes_to_chunk([image_episode(stacked_frames(rng, 20, size=16), "e0")[0]], options)
    outbox, segments, _ = make(tmp_path)
    outbox.add(sample)
    (record,) = records(segments.directory)
    sent, got = sample.streams["default_agent"], record.chunk.streams["default_agent"]
    assert got.stacked == sent.stacked and got.encoded == sent.encoded and got.heads == sent.heads
    for table in ("steps", "fragments"):
        for path, values in getattr(sent, table).items():
            if values.dtype == object:
                assert [bytes(v) if not isinstance(v, str) else v for v in getattr(got, table)[path]] == [
                    bytes(v) if not isinstance(v, str) else v for v in values]
            else:
                np.testing.assert_array_equal(getattr(got, table)[path], values)
