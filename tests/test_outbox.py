"""Flow control with a scripted transport and a fake clock: milliseconds, no Ray, no sleeping."""

import numpy as np
import pytest

from rllib_recorder.convert import episodes_to_chunk
from rllib_recorder.outbox import Outbox
from tests.helpers import make_episode


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class FakeTransport:
    """Acks a chunk once ``complete`` is called for it; ``fail`` makes its next result raise."""

    def __init__(self, clock, auto_ack=False):
        self.clock, self.auto_ack = clock, auto_ack
        self.sent, self.done, self.failing, self.refusing = [], set(), set(), set()
        self.stored = {}

    def send(self, sender_id, seq, chunk, stats):
        handle = (seq, len(self.sent))
        self.sent.append((seq, chunk.agent_steps))
        if self.auto_ack:
            self.complete(handle)
        return handle

    def complete(self, handle):
        self.done.add(handle)

    def wait(self, handles, timeout_s):
        ready = [h for h in handles if h in self.done]
        if not ready:
            self.clock.sleep(timeout_s)
        return ready

    def retryable(self, error):
        return isinstance(error, ConnectionError)

    def result(self, handle):
        if handle in self.refusing:
            raise ValueError("writer refused the chunk")
        if handle in self.failing:
            self.failing.discard(handle)
            raise ConnectionError("writer died")
        self.stored.setdefault(handle[0], 0)
        self.stored[handle[0]] += 1
        return {"seq": handle[0], "rows": 2}


def chunk(n=2):
    return episodes_to_chunk([make_episode(n)])


def make(transport_kwargs=None, **kwargs):
    clock = FakeClock()
    transport = FakeTransport(clock, **(transport_kwargs or {}))
    return Outbox(transport, clock=clock, sleep=clock.sleep, **kwargs), transport, clock


def test_small_samples_are_coalesced_until_enough_rows():
    outbox, transport, _ = make(dict(auto_ack=True), coalesce_rows=5, coalesce_s=60)
    outbox.add(chunk(2))
    outbox.add(chunk(2))
    assert transport.sent == []
    outbox.add(chunk(2))
    assert transport.sent == [(0, 6)]


def test_samples_of_another_policy_version_are_never_coalesced_with_those_held():
    outbox, transport, _ = make(dict(auto_ack=True), coalesce_rows=1000, coalesce_s=60)
    sent = []
    send = transport.send
    transport.send = lambda sender, seq, c, stats: sent.append(c.policy_versions.tolist()) or send(sender, seq, c, stats)
    mixed = episodes_to_chunk([make_episode(2, version=4), make_episode(1, version=5)])
    for c in (episodes_to_chunk([make_episode(2, version=3)]), episodes_to_chunk([make_episode(1, version=3)]),
              episodes_to_chunk([make_episode(2, version=4)]), mixed, mixed,
              episodes_to_chunk([make_episode(1, version=5)])):
        outbox.add(c)
    outbox.flush()
    assert sent == [[3, 3, 3], [4, 4], [4, 4, 5, 4, 4, 5], [5]]


def test_held_rows_are_sent_once_old_enough():
    outbox, transport, clock = make(dict(auto_ack=True), coalesce_rows=1000, coalesce_s=1.0)
    outbox.add(chunk())
    clock.now = 1.5
    outbox.add(chunk())
    assert transport.sent == [(0, 4)]


def test_full_window_blocks_until_an_ack_and_counts_the_wait():
    outbox, transport, clock = make(window=2, max_wait_s=100)
    outbox.add(chunk())
    outbox.add(chunk())
    # Nothing is acknowledged: the third add waits (the fake clock advances while it waits).
    first = (0, 0)

    def ack_after_a_quarter_second(handles, timeout_s):
        if timeout_s == 0:
            return []
        clock.sleep(0.25)
        return [first]

    transport.wait = ack_after_a_quarter_second
    outbox.add(chunk())
    assert [s for s, _ in transport.sent] == [0, 1, 2]
    assert outbox.stats.wait_s == pytest.approx(0.25) and outbox.stats.chunks_dropped == 0


def test_drop_policy_drops_and_counts_without_waiting():
    outbox, transport, clock = make(window=1, policy="drop")
    outbox.add(chunk())
    outbox.add(chunk(3))
    assert [s for s, _ in transport.sent] == [0]
    assert outbox.stats.chunks_dropped == 1 and outbox.stats.rows_dropped == 3
    assert clock.now == 0.0


def test_block_gives_up_after_max_wait_and_counts_an_error():
    outbox, transport, clock = make(window=1, max_wait_s=3)
    outbox.add(chunk())
    outbox.add(chunk())
    assert clock.now >= 3 and outbox.stats.chunks_dropped == 1 and outbox.stats.send_errors == 1


def test_failed_chunk_is_resent_with_the_same_seq_and_kept_until_acked():
    outbox, transport, clock = make(window=4)
    outbox.add(chunk())
    transport.failing.add((0, 0))
    transport.complete((0, 0))
    outbox.poll()
    assert outbox.in_flight == 1 and outbox.stats.send_errors == 1
    clock.now += 10
    outbox.poll()  # resend is due: same seq, new handle
    assert transport.sent == [(0, 2), (0, 2)] and outbox.stats.resends == 1
    transport.complete((0, 1))
    outbox.poll()
    assert outbox.in_flight == 0 and transport.stored == {0: 1}


def test_drain_sends_pending_and_waits_for_every_ack():
    outbox, transport, _ = make(dict(auto_ack=True), coalesce_rows=1000, coalesce_s=60)
    outbox.add(chunk())
    assert outbox.drain(timeout_s=5) == 0
    assert transport.sent == [(0, 2)] and outbox.stats.chunks_acked == 1


def test_drain_times_out_and_reports_what_is_left():
    outbox, transport, clock = make()
    outbox.add(chunk())
    assert outbox.drain(timeout_s=2) == 1
    assert clock.now >= 2


def test_refused_chunk_is_counted_as_failed_not_resent():
    outbox, transport, clock = make(window=4)
    outbox.add(chunk(3))
    transport.refusing.add((0, 0))
    transport.complete((0, 0))
    outbox.poll()
    clock.now += 100
    outbox.poll()
    assert outbox.in_flight == 0 and len(transport.sent) == 1
    assert outbox.stats.chunks_failed == 1 and outbox.stats.rows_failed == 3


def test_coalesced_frames_are_sent_as_uint8_codes_and_kept_that_way_for_resending():
    from tests.helpers import image_episode

    rng = np.random.default_rng(3)
    outbox, transport, _ = make(dict(), coalesce_rows=6, coalesce_s=60, encode=True)
    sent = []
    transport.send = lambda sender_id, seq, c, stats: sent.append(c) or (seq, 0)
    parts = [image_episode(rng.integers(0, 256, size=(4, 6, 6, 1)), f"e{i}") for i in range(2)]
    for episode, _ in parts:
        outbox.add(episodes_to_chunk([episode]))
    (chunk_sent,) = sent
    stream = chunk_sent.streams["default_agent"]
    assert stream.steps["obs"].dtype == np.uint8 and stream.encoded["steps/obs"] == (1 / 128, -1.0)
    assert np.array_equal(stream.steps["obs"].astype(np.float32) / 128 - 1,
                          np.concatenate([frames[:-1] for _, frames in parts]))
    assert chunk_sent.nbytes == sum(episodes_to_chunk([e]).nbytes for e, _ in parts)
    assert outbox._in_flight[0].chunk is chunk_sent  # a resend sends the same codes


def test_coalesce_bytes_counts_the_arrays_as_held_not_the_float32_stacks_they_stand_for():
    from rllib_recorder.convert import ConvertOptions
    from tests.helpers import image_episode, stacked_frames

    rng = np.random.default_rng(5)
    options = ConvertOptions(encode_images=True, stack_frames=True)
    samples = [episodes_to_chunk([image_episode(stacked_frames(rng, 20, size=16), f"e{i}")[0]], options)
               for i in range(3)]
    one = samples[0]
    # an Atari-like sample: uint8 newest frames, 16x fewer bytes than the float32 stacks it stands for
    assert one.held_nbytes < one.nbytes / 8
    assert one.held_nbytes == sum(a.nbytes for s in one.streams.values() for a in (*s.steps.values(),
                                                                                   *s.fragments.values()))
    outbox, transport, _ = make(dict(auto_ack=True), coalesce_rows=1000, coalesce_s=60,
                                coalesce_bytes=2 * one.held_nbytes + 1)
    outbox.add(samples[0])
    outbox.add(samples[1])  # raw bytes would be far over the limit: held, not sent
    assert transport.sent == []
    outbox.add(samples[2])
    assert transport.sent == [(0, 60)]
