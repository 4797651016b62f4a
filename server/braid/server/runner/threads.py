"""How many threads a forward pass runs on, chosen by how fast decode passes go.

The kernels split each matmul's columns evenly over their threads (OpenMP, static) and meet at a
barrier some 150 times a token, so a pass runs at the speed of its slowest thread. When another
process takes one of the cores, the thread that shares it holds up all the others at every barrier:
on 2 cores beside one busy process, 2 threads decoded 37 to 90 tokens/s where 1 thread decoded 200
to 265 (docs/benchmarks.md, "Sharing the cores"). Neither the affinity mask nor a cgroup quota says that
the cores are busy, so the governor measures it: now and then it runs a few decode passes on the
next smaller (or larger) count and keeps whichever is faster by a clear margin. A trial that loses
doubles the wait before the next one (up to 256 passes, about a second), so a quiet machine pays
about 1% for the watch; one far slower ends after its first pass. When the current count's own
passes slow down (a neighbour starts), a trial of fewer threads comes at once, and so does a trial
when work resumes after a pause.

The count changes the speed only: each column of a matmul, and each head of attention, is computed
by one thread whatever their number, so a pass's tokens are the same on any count.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable

TRIAL_PASSES = 8  # decode passes a trial runs on the other count
EXPLORE_EVERY = 64  # passes between trials, at first and after a switch
MAX_BACKOFF = 4  # a trial that loses doubles the wait, up to this many times EXPLORE_EVERY
IDLE_S = 1.0  # passes after a pause this long start with a trial: the neighbours may have changed
# A trial wins when its passes take at most this fraction of the current count's: a clear margin to
# drop threads, a small one to take them back (2 threads were only 1.26x faster than 1 here, and a
# wrong move up is seen by the watch on slowdowns within a few passes).
MARGIN_DOWN, MARGIN_UP = 0.85, 0.95
GIVE_UP = 1.5  # a trial whose passes take this many times the current count's ends at once,
GIVE_UP_AT_ONCE = 3.0  # after MIN_SAMPLES passes, or after its first at this many times
CHANGE = 1.3  # the current count's passes this much slower than after the last trial: look again
MIN_SAMPLES = 3  # passes of each count, of the same shape, before they are compared


class ThreadGovernor:
    """Picks the thread count of each pass among `most`, most // 2, ..., 1. Call `pick(shape)` before
    a decode pass and `record(shape, count, seconds)` after it; `shape` is what makes passes
    comparable (their number of rows). Not thread-safe: the model thread's alone."""

    def __init__(self, most: int, *, explore_every: int = EXPLORE_EVERY, trial_passes: int = TRIAL_PASSES) -> None:
        self.counts = sorted({max(1, most >> i) for i in range(most.bit_length())}, reverse=True)
        self.current = self.counts[0]
        self.explore_every, self.trial_passes = explore_every, trial_passes
        self.num_switches = 0
        self._times: dict[tuple[int, Hashable], deque[float]] = {}
        self._reference: dict[Hashable, float] = {}  # the current count's pass time per shape, after a trial
        self._trial: int | None = None  # the count on trial
        self._trial_left = 0
        self._next: int | None = None  # the count the next trial tries (None: the neighbours in turn)
        self._wait = explore_every
        self._until_trial = explore_every
        self._downwards = True  # which neighbour the next trial tries, where there are two
        self._last_pass = float("-inf")

    def pick(self, shape: Hashable, now: float | None = None) -> int:
        """The count the next pass runs on; `now` (seconds, monotonic) tells a pause."""
        if now is not None:
            if now - self._last_pass > IDLE_S:  # the next trial soon (the waits after it as they were)
                self._until_trial = min(self._until_trial, MIN_SAMPLES + 1)
            self._last_pass = now
        if self._trial is None and len(self.counts) > 1:
            self._until_trial -= 1
            if self._until_trial <= 0 and len(self._times.get((self.current, shape), ())) >= MIN_SAMPLES:
                self._trial, self._next = self._next or self._neighbour(), None
                self._trial_left = self.trial_passes
                for (count, _), times in self._times.items():
                    if count == self._trial:
                        times.clear()  # measured under other conditions: not comparable now
        return self._trial if self._trial is not None else self.current

    def record(self, shape: Hashable, count: int, seconds: float) -> None:
        times = self._times.setdefault((count, shape), deque(maxlen=self.trial_passes))
        times.append(seconds)
        if self._trial is not None:
            if count == self._trial:
                self._trial_left -= 1
                ratios = self._ratios(MIN_SAMPLES)
                losing = ratios and min(ratios) >= GIVE_UP or min(self._ratios(1), default=0) >= GIVE_UP_AT_ONCE
                if self._trial_left <= 0 or losing:
                    self._decide(ratios)
            return
        if count == self.current and len(times) == times.maxlen:
            self._watch(shape, statistics.median(times))

    def _watch(self, shape: Hashable, now: float) -> None:
        """Calls a trial of fewer threads at once when the current count's passes slow down: a
        neighbour took a core. (A speed-up is left to the next trial: where the current count is
        the smallest, a neighbour leaving hardly changes its speed, and trying more threads while
        the cores are still busy costs passes many times slower.)"""
        reference = self._reference.setdefault(shape, now)
        i = self.counts.index(self.current)
        if now > CHANGE * reference and i + 1 < len(self.counts):
            self._reference[shape] = now
            self._next, self._until_trial = self.counts[i + 1], 0

    def _neighbour(self) -> int:
        i = self.counts.index(self.current)
        if i == 0 or (i < len(self.counts) - 1 and self._downwards):
            return self.counts[i + 1]
        return self.counts[i - 1]

    def _ratios(self, samples: int) -> list[float]:
        """For each shape the trial's count has run `samples` passes of, and the current one
        MIN_SAMPLES: the trial's pass time over the current count's (medians)."""
        return [
            statistics.median(times) / statistics.median(self._times[self.current, shape])
            for (count, shape), times in self._times.items()
            if count == self._trial
            and len(times) >= samples
            and len(self._times.get((self.current, shape), ())) >= MIN_SAMPLES
        ]

    def _decide(self, ratios: list[float]) -> None:
        trial, self._trial = self._trial, None
        self._reference.clear()
        margin = MARGIN_UP if trial > self.current else MARGIN_DOWN
        if ratios and max(ratios) <= margin:
            self.current = trial
            self.num_switches += 1
            self._wait = self.explore_every
        else:
            self._wait = min(2 * self._wait, MAX_BACKOFF * self.explore_every)
            self._downwards = not self._downwards
        self._until_trial = self._wait
