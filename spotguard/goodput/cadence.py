"""`save_interval_s="auto"`: the save interval that costs least, by Young/Daly.

Saving every T seconds costs the save's stall on the training thread, C, T times less often; an
interruption whose emergency save does not commit (no notice, a hard kill, a node lost) loses on
average T/2 of work. With M the mean time between interruptions, the expected loss per second of
running, C/T + T/(2M), is least at

    T* = sqrt(2 x C x M)          (Young 1974; Daly 2006 for the higher-order terms, negligible when C << M)

bounded to [min_s, max_s]. C is the median stall of this run's recent background saves (before
the first one is measured, the interval is min_s, so one is measured soon). The interruption rate
1/M is a gamma-Poisson estimate: (k + r0 x W) / (H + W), with k the interruptions the ledger saw
in H hours of running (earlier segments and this one), each AWS rebalance recommendation counted
as one more interruption (AWS sends one when the risk of interruption has risen), and a prior r0
per hour (`interruptions_per_hour`, e.g. from the AWS Spot Advisor's frequency band; one a day
without one) that weighs as much as W = 4 hours of running.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_MIN_S = 60.0
DEFAULT_MAX_S = 3600.0
DEFAULT_RATE_PER_H = 1 / 24  # no prior and no history: one interruption a day
PRIOR_WEIGHT_H = 4.0  # the prior counts as this many hours of running (bench/cadence_sim.py: 2 to 8 do well)
RECENT_SAVES = 8  # C is the median stall of this many most recent background saves
CHANGE = 0.05  # a new interval differing from the last one by more than this fraction is logged
RECHECK_S = 1.0  # how often a waiting IntervalTimer asks its interval again
# A fleet-wide AWS rebalance recommendation reaches every node leader, each of which asks for a
# save: the requests of one wave, this close together, count once.
SAME_WAVE_S = 600.0


def young_daly(save_cost_s: float, mtbi_s: float) -> float:
    """The interval that minimises save overhead plus expected lost work: sqrt(2 x C x M)."""
    return math.sqrt(2.0 * save_cost_s * mtbi_s)


@dataclasses.dataclass(frozen=True)
class Choice:
    interval_s: float
    save_cost_s: float | None  # None: no save measured yet
    rate_per_h: float
    interruptions: int  # k: seen in the ledger's history, this run, plus rebalance recommendations
    hours: float  # H: hours of running behind the estimate
    bound: str | None  # "min" or "max" when the bound decided
    name: str = "save"  # what is taken at this interval: "save" or "snapshot"

    def explain(self) -> str:
        if self.save_cost_s is None:
            taken = "background save" if self.name == "save" else self.name
            return f"{self.interval_s:.3g} s (the lower bound, until a {taken} has been measured)"
        mtbi = 3600.0 / self.rate_per_h
        why = (
            f"sqrt(2 x {self.save_cost_s:.3f} s {self.name} stall x {mtbi / 3600:.1f} h between interruptions)"
            f" = {young_daly(self.save_cost_s, mtbi):.3g} s"
        )
        clamp = f", held at the {self.bound} bound" if self.bound else ""
        return (
            f"{self.interval_s:.3g} s: {why}{clamp}; rate {self.rate_per_h:.3f}/h from {self.interruptions} "
            f"interruption(s) in {self.hours:.1f} h"
        )

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "explain": self.explain()}


class Cadence:
    """The adaptive interval; fed with measured stalls and interruption counts, asked at each wait.

    Fed and asked from different threads (the save worker, the listener, the interval timer).
    """

    def __init__(
        self,
        min_s: float = DEFAULT_MIN_S,
        max_s: float = DEFAULT_MAX_S,
        prior_per_hour: float | None = None,
        on_change: Callable[[Choice], Any] | None = None,
        name: str = "save",
    ) -> None:
        self.min_s, self.max_s = min_s, max_s
        self.name = name  # what the interval is between, in the log: "save" or "snapshot"
        self.prior_per_hour = DEFAULT_RATE_PER_H if prior_per_hour is None else prior_per_hour
        self._lock = threading.Lock()
        self._costs: deque[float] = deque(maxlen=RECENT_SAVES)
        self._history = (0, 0.0)  # (interruptions, hours) of earlier segments
        self._seen = 0  # interruptions and rebalance recommendations during this run
        self._last_seen_at: float | None = None  # time.monotonic() of the last one counted
        self.on_change = on_change
        self.last: Choice | None = None  # the interval now
        self._announced: Choice | None = None  # the interval last logged (drift is measured from it)

    def observe_save(self, stall_s: float) -> None:
        with self._lock:
            self._costs.append(stall_s)

    def observe_history(self, interruptions: int, hours: float) -> None:
        with self._lock:
            self._history = (interruptions, hours)

    def observe_interruption(self, now: float | None = None) -> None:
        """An interruption, or a rebalance recommendation, during this run (`now`: time.monotonic());
        several within SAME_WAVE_S of the last one counted are one wave, counted once."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._last_seen_at is not None and now - self._last_seen_at < SAME_WAVE_S:
                return
            self._last_seen_at = now
            self._seen += 1

    def rate_per_hour(self, run_hours: float) -> tuple[float, int, float]:
        """(rate, k, H) after `run_hours` of this run."""
        with self._lock:
            k = self._history[0] + self._seen
            hours = self._history[1] + run_hours
        return (k + self.prior_per_hour * PRIOR_WEIGHT_H) / (hours + PRIOR_WEIGHT_H), k, hours

    def interval(self, run_hours: float) -> float:
        """The interval to wait now; a change is logged and reported to `on_change`."""
        rate, k, hours = self.rate_per_hour(run_hours)
        with self._lock:
            cost = statistics.median(self._costs) if self._costs else None
        if cost is None:
            value, bound = self.min_s, "min"
        else:
            ideal = young_daly(cost, 3600.0 / rate)
            value = min(self.max_s, max(self.min_s, ideal))
            bound = "min" if ideal < self.min_s else "max" if ideal > self.max_s else None
        choice = Choice(value, cost, rate, k, hours, bound, self.name)
        said = self._announced
        if said is None or abs(value - said.interval_s) > CHANGE * said.interval_s:
            log.info("%s interval (auto): %s", self.name, choice.explain())
            self._announced = choice
            if self.on_change is not None:
                self.on_change(choice)
        self.last = choice
        return value


class IntervalTimer:
    """Asks for a save every `interval()` seconds, counted from the last request, on a daemon thread,
    until stopped. `interval()` is asked again every RECHECK_S while waiting: an adaptive cadence
    learns the cost of a save only once that save (asked at the end of the last wait) is taken, and
    its new interval then applies to the wait under way, not only to the one after. A failed request
    (a store hiccup) skips one save, not all of them."""

    def __init__(self, interval: Callable[[], float], request: Callable[[], None]) -> None:
        self._interval = interval
        self._request = request
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="spotguard-interval", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            remaining = last + self._interval() - time.monotonic()
            if self._stop.wait(max(0.0, min(remaining, RECHECK_S))):  # also between requests that run long
                return
            if remaining > RECHECK_S:
                continue
            last = time.monotonic()
            try:
                self._request()
            except Exception as exc:  # noqa: BLE001 - logged; the next interval tries again
                log.warning("could not request an interval checkpoint: %s", exc)
