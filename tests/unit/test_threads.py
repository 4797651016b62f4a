"""The thread governor: decode passes on fewer threads while that is faster, told by scripted pass
times (no clock)."""

from __future__ import annotations


from braid.server.runner.threads import MAX_BACKOFF, ThreadGovernor


def run(governor: ThreadGovernor, passes: int, seconds: dict[int, float], shape: int = 1) -> list[int]:
    """`passes` decode passes, each taking seconds[count]; the counts they ran on."""
    counts = []
    for _ in range(passes):
        count = governor.pick(shape)
        governor.record(shape, count, seconds[count])
        counts.append(count)
    return counts


QUIET = {2: 0.0035, 1: 0.005}  # 2 threads faster: both cores free
SHARED = {2: 0.021, 1: 0.005}  # beside a busy process: 1 thread faster


def test_the_counts_halve_down_to_one() -> None:
    assert ThreadGovernor(16).counts == [16, 8, 4, 2, 1]
    assert ThreadGovernor(6).counts == [6, 3, 1]
    assert ThreadGovernor(1).counts == [1]


def test_on_quiet_cores_it_keeps_every_thread_and_tries_less_often() -> None:
    governor = ThreadGovernor(2, explore_every=16, trial_passes=4)
    counts = run(governor, 2000, QUIET)
    assert governor.current == 2 and governor.num_switches == 0
    trials = counts.count(1) // 4
    assert trials <= 2000 // (MAX_BACKOFF * 16) + 2  # the waits double: 16, 32, ... up to MAX_BACKOFF x 16
    assert counts[-MAX_BACKOFF * 16 :].count(1) <= 4  # at most one trial in the last full wait


def test_beside_a_busy_process_it_moves_to_fewer_threads_and_back_when_it_ends() -> None:
    governor = ThreadGovernor(2, explore_every=16, trial_passes=4)
    run(governor, 100, QUIET)
    assert governor.current == 2
    run(governor, 100, SHARED)
    assert governor.current == 1
    run(governor, MAX_BACKOFF * 16 + 50, QUIET)
    assert governor.current == 2 and governor.num_switches == 2


def test_a_neighbour_that_starts_after_a_long_quiet_spell_is_seen_at_once() -> None:
    governor = ThreadGovernor(2, explore_every=16, trial_passes=4)
    run(governor, 20_000, QUIET)  # the waits between trials at their longest
    run(governor, 12, SHARED)  # slower by more than CHANGE: a trial at once
    assert governor.current == 1
    run(governor, 30, QUIET)  # it left: 1 thread is no faster, but a switch starts the waits afresh
    assert governor.current == 2


def test_a_trial_that_is_clearly_losing_ends_early() -> None:
    governor = ThreadGovernor(2, explore_every=16, trial_passes=8)
    run(governor, 100, SHARED)
    assert governor.current == 1
    counts = run(governor, 3000, SHARED)
    trials = sum(1 for a, b in zip(counts, counts[1:]) if a == 1 and b == 2)
    assert trials >= 4 and counts.count(2) == trials  # one pass each: 4x slower, not eight


def test_work_after_a_pause_starts_with_a_trial() -> None:
    governor = ThreadGovernor(2, explore_every=16, trial_passes=4)
    run(governor, 100, SHARED)
    run(governor, 2000, SHARED)  # the waits between trials at their longest
    assert governor.current == 1
    counts = []
    for i in range(12):  # the neighbours left while the server was idle
        count = governor.pick(1, now=100.0 + i * 0.005)
        governor.record(1, count, QUIET[count])
        counts.append(count)
    assert governor.current == 2 and counts.index(2) <= 4


def test_threads_come_back_for_a_small_gain_but_go_only_for_a_clear_one() -> None:
    governor = ThreadGovernor(2, explore_every=16, trial_passes=4)
    run(governor, 100, SHARED)
    assert governor.current == 1
    run(governor, 200, {2: 0.0045, 1: 0.005})  # 2 threads 10% faster: back to 2
    assert governor.current == 2
    run(governor, 500, {2: 0.0045, 1: 0.0042})  # 1 thread 7% faster: not enough to leave 2
    assert governor.current == 2 and governor.num_switches == 2


def test_passes_of_other_shapes_are_not_compared() -> None:
    governor = ThreadGovernor(2, explore_every=4, trial_passes=4)
    for _ in range(100):  # 2 threads see passes of eight rows; the trials on 1 thread happen to see one row
        count = governor.pick(8)
        governor.record(8 if count == 2 else 1, count, 0.010 if count == 2 else 0.001)
    assert governor.current == 2 and governor.num_switches == 0


def test_one_thread_has_nothing_to_choose() -> None:
    governor = ThreadGovernor(1, explore_every=1, trial_passes=1)
    assert set(run(governor, 50, {1: 0.01})) == {1}
