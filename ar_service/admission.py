"""Admission of image requests against the capacity of the whole AR+DiT pair: decided at arrival, priced by the
work each request asks. Why these rules: docs/api.md ("Admission").

- At most ``capacity`` requests are in flight (what the DiTs announced they hold); beyond that a request waits in
  line, at most ``max_queued`` of them.
- A request's wait is the work admitted before it and not finished, in flight and in line, at the pair's pace
  (``Pace``: seconds a request, a megapixel and a unit of denoising cost). A request whose wait would pass
  ``max_wait`` is refused at once (429, ``Retry-After`` the time until it would fit). A request admitted is served:
  it leaves the line only to start, or when its client leaves.
- A request is priced at arrival as an unread one (``unread_load``), and again once its body is read
  (``AdmissionPlace.price``): its wait is then the requests admitted before it and not finished, at what they ask,
  and those that passed it in line; past ``max_wait`` it is refused then.
- With API keys, one key's requests in flight and in line may hold at most ``max_key_wait`` of work at the pace
  (one request a key may always have); past it the key's request is refused when priced.
- Keys take turns in line, first come first served within a key: when a slot frees, the key that started a
  request least lately starts its oldest, if it passes only priced requests, is priced itself, and each request in
  line it passes can take its price within ``max_wait`` (it is added to their waits); else the next key's oldest,
  and so on. The oldest request in line passes nobody. Without keys the line is first come first served.
- The pace is the DiTs' announced split (``DitCapabilities.pace``) scaled to the time between completions over the
  last ``_WINDOW``, those that ended while requests waited in line first. Without an announced split all of a
  request's time is its work, and until a completion one round of ``capacity`` requests may wait.

Everything runs on the event loop thread, so plain counters and futures are enough.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator

from ar_service.metrics import ArMetrics
from services.errors import Overloaded
from shared.capabilities import Load, Pace

# Completions the pace is measured over.
_WINDOW = 32
# How the time of a request splits where the DiTs announced no pace: all of it by its work.
_BY_WORK_ALONE = Pace(per_request=0.0, per_work=1.0)
# Bounds of Retry-After, in seconds.
_RETRY_AFTER = (1, 60)


class AdmissionTicket:
    """One admitted request's slot; ``release`` is idempotent. ``served``: the request's work completed
    (only those measure the pace; a failure or a client that left says nothing about it)."""

    def __init__(self, admission: RequestAdmission, place: AdmissionPlace) -> None:
        self._admission = admission
        self._place = place
        self._held = True

    def release(self, served: bool) -> None:
        if self._held:
            self._held = False
            self._admission.finished(self._place, served)


class AdmissionPlace:
    """A request's place, taken at arrival: a slot already, or a turn in line. ``turn`` gives the slot
    as a ticket (waiting for it if needed); ``leave`` gives the place up, once, if the ticket was not taken."""

    def __init__(
        self, admission: RequestAdmission, turn: asyncio.Future[None], load: Load, ahead: Load, tenant: str | None
    ) -> None:
        self._admission = admission
        self._turn = turn
        self.load = load
        self.tenant = tenant  # whose API key (None without keys)
        self.priced = False  # its load is what it asks, not a guess
        self.ahead = ahead  # what its render waits for: its wait at the pace
        self.passed_by = Load()  # the requests that started before it from behind it in line
        self.counted = False  # in the admission's load ahead of later arrivals
        self._entered_at = time.monotonic()
        self._settled = False

    @property
    def started(self) -> bool:
        """The slot is this request's: ``turn`` returns at once."""
        return self._turn.done() and not self._turn.cancelled()

    @property
    def in_line(self) -> bool:
        return not self._turn.done()

    def start(self) -> None:
        """Its turn has come: the slot is its own."""
        self._turn.set_result(None)

    def price(self, load: Load, tenant: str | None = None) -> None:
        """What the request really asks, once known, and whose key sent it: the requests after it are priced
        against it. ``Overloaded`` when the requests before it at their prices, and those that passed it, would
        hold its render past the wait promised, or its key's requests, with it, would hold more than its share."""
        self._admission.repriced(self, load, tenant)

    async def turn(self) -> AdmissionTicket:
        try:
            await self._turn
        except BaseException:
            self.leave()  # the client left while in line
            raise
        self._settled = True
        self._admission.observe_wait(time.monotonic() - self._entered_at)
        return AdmissionTicket(self._admission, self)

    def leave(self) -> None:
        if not self._settled:
            self._settled = True
            self._admission.left(self, self._turn)


class RequestAdmission:
    def __init__(self, max_queued: int, max_wait: float, metrics: ArMetrics, max_key_wait: float | None = None) -> None:
        self._max_queued = max_queued
        self._max_wait = max_wait
        self._max_key_wait = max_key_wait
        self._metrics = metrics
        self._waiting: deque[AdmissionPlace] = deque()
        self._running = 0
        self._ahead = Load()  # of every place admitted and not finished, in flight or in line
        self._counted: dict[AdmissionPlace, None] = {}  # those places, in the order they arrived
        self._capacity = 1
        self._announced: Pace | None = None
        # (seconds between completions while busy, the completed request's load), and those that ended with
        # requests waiting in line.
        self._busy: deque[tuple[float, Load]] = deque(maxlen=_WINDOW)
        self._line: deque[tuple[float, Load]] = deque(maxlen=_WINDOW)
        self._busy_since: float | None = None
        self._last_completion = float("-inf")
        self._read: deque[Load] = deque(maxlen=_WINDOW)  # what the requests priced lately asked
        self._starts = 0  # requests started so far
        self._last_start: dict[str | None, int] = {}  # by key: the number of its last start

    @property
    def in_flight(self) -> int:
        return self._running

    def enter(
        self, capacity: int, load: Load, announced_pace: Pace | None = None, tenant: str | None = None
    ) -> AdmissionPlace:
        """A slot among ``capacity`` now, or a place in line, for a request priced at ``load`` until it is
        priced again; ``Overloaded`` (429) at once when the line is full or the wait would be longer than
        ``max_wait``. ``announced_pace``: the DiTs' own, from their warm-up; ``tenant``: whose API key sent it."""
        self._capacity = capacity
        if announced_pace is not None:
            self._announced = announced_pace
        if self._waiting and self._running < capacity:
            self._start_waiting()  # the DiTs announced more room since the last request
        # A refusal is decided before anything is made for it: in a burst, most arrivals end here.
        wait = self._within_wait(self.estimated_wait())
        if self._running < capacity and not self._waiting:
            started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            started.set_result(None)
            place = AdmissionPlace(self, started, load, self._ahead, tenant)
            self._start(place)
            return place
        ahead = len(self._waiting)
        if ahead >= self._max_queued:
            raise self._refuse(f"the queue is full ({self._max_queued} requests wait)", _over(wait, self._max_wait))
        if wait is None and ahead >= capacity:
            raise self._refuse("the pace of this service is not measured yet; one round may wait", None)
        place = AdmissionPlace(self, asyncio.get_running_loop().create_future(), load, self._ahead, tenant)
        self._waiting.append(place)
        self._count(place)
        self._metrics.requests_queued.set(len(self._waiting))
        return place

    @property
    def pace(self) -> Pace | None:
        """The announced pace scaled to what the pair took as the line moved (else while busy), else the announced
        one; None when neither is known."""
        window = self._line or self._busy
        if not window:
            return self._announced
        split = self._announced or _BY_WORK_ALONE
        took = sum(seconds for seconds, _ in window)
        priced = sum(split.seconds(load) for _, load in window)
        if priced <= 0:  # a split that prices these requests at nothing: then their time is all per request
            return Pace(per_request=took / len(window), per_work=0.0)
        return split.scaled(took / priced)

    def unread_load(self, default: Load) -> Load:
        """What a request whose body is not read yet is priced at: ``default`` (the DiTs' default request), or what
        the last requests read asked on average where that is lighter, part by part. A guess too light only lets the
        request be read: its real price is checked then (``repriced``), before any work, so nothing is admitted past
        the promise. A guess too heavy refuses it unread, for work it may not ask for."""
        if not self._read:
            return default
        return Load(
            1,
            min(default.megapixels, sum(load.megapixels for load in self._read) / len(self._read)),
            min(default.work, sum(load.work for load in self._read) / len(self._read)),
        )

    def estimated_wait(self) -> float | None:
        """Seconds until a request arriving now would start its render: what everything admitted and not finished
        costs, at the pace."""
        pace = self.pace
        return None if pace is None else pace.seconds(self._ahead)

    def repriced(self, place: AdmissionPlace, load: Load, tenant: str | None = None) -> None:
        if place.counted:
            self._ahead += load - place.load
        place.load, place.tenant, place.priced = load, tenant, True
        self._read.append(load)
        pace = self.pace
        if pace is None or not place.counted:
            return
        before = own = Load()
        ahead = True
        for other in self._counted:
            if other is place:
                ahead = False
                continue
            if ahead:
                before += other.load
            if tenant is not None and other.tenant == tenant and other.priced:
                # Before or after it, whichever order the bodies arrived in; not one still unread, priced at a guess:
                # its own pricing counts it.
                own += other.load
        place.ahead = before + place.passed_by
        self._within_wait(pace.seconds(place.ahead))
        own_wait = pace.seconds(own + load)
        if tenant is not None and self._max_key_wait is not None and own.requests and own_wait > self._max_key_wait:
            raise self._refuse(
                f"this API key's requests in line would hold about {own_wait:.0f} s of work, over its share of "
                f"{self._max_key_wait:g} s",
                own_wait - self._max_key_wait,
            )

    def finished(self, place: AdmissionPlace, served: bool) -> None:
        if served:
            now = time.monotonic()
            since = max(self._last_completion, self._busy_since if self._busy_since is not None else now)
            sample = (now - since, place.load)
            self._busy.append(sample)
            if self._waiting:
                self._line.append(sample)
            pace = self.pace
            if pace is not None:
                self._metrics.admission_seconds_per_request.set(pace.per_request)
                self._metrics.admission_seconds_per_megapixel.set(pace.per_megapixel)
                self._metrics.admission_seconds_per_work.set(pace.per_work)
            self._last_completion = now
        self._end_one(place)

    def _end_one(self, place: AdmissionPlace) -> None:
        self._running -= 1
        self._uncount(place)
        if self._running == 0:
            self._busy_since = None
        self._start_waiting()

    def left(self, place: AdmissionPlace, turn: asyncio.Future[None]) -> None:
        """A place given up before its ticket was taken: a slot already handed to it goes to the next in line."""
        if turn.done() and not turn.cancelled():
            self._end_one(place)
            return
        turn.cancel()
        if place in self._waiting:
            self._waiting.remove(place)
        self._uncount(place)
        self._metrics.requests_queued.set(len(self._waiting))

    def observe_wait(self, seconds: float) -> None:
        self._metrics.queue_wait_seconds.observe(seconds)

    def _count(self, place: AdmissionPlace) -> None:
        if not place.counted:
            place.counted = True
            self._counted[place] = None
            self._ahead += place.load

    def _uncount(self, place: AdmissionPlace) -> None:
        if place.counted:
            place.counted = False
            del self._counted[place]
            self._ahead -= place.load
        if self._ahead.requests == 0:
            self._ahead = Load()  # no drift from float sums once nothing is ahead

    def _start(self, place: AdmissionPlace) -> None:
        self._starts += 1
        self._last_start[place.tenant] = self._starts
        self._running += 1
        self._count(place)
        if self._busy_since is None:
            self._busy_since = time.monotonic()
        self._metrics.requests_in_flight.set(self._running)

    def _start_waiting(self) -> None:
        while self._waiting and self._running < self._capacity:
            place = self._next_turn()
            for passed in _before(place, self._waiting):
                passed.ahead += place.load
                passed.passed_by += place.load
            self._waiting.remove(place)
            if place.in_line:
                self._start(place)
                place.start()
        self._metrics.requests_in_flight.set(self._running)
        self._metrics.requests_queued.set(len(self._waiting))

    def _next_turn(self) -> AdmissionPlace:
        """The place in line whose turn it is: of each key's oldest, the first that may pass the places before it,
        keys in the order they last started one (one that has not, first)."""
        oldest: dict[str | None, AdmissionPlace] = {}
        for place in self._waiting:
            oldest.setdefault(place.tenant, place)
        for place in sorted(oldest.values(), key=lambda place: self._last_start.get(place.tenant, 0)):
            if self._may_pass(place):
                return place
        return self._waiting[0]

    def _may_pass(self, place: AdmissionPlace) -> bool:
        """Whether ``place`` may start before the places in line that arrived before it: all of them priced, as it
        is, and each able to take its price within ``max_wait``."""
        before = list(_before(place, self._waiting))
        if not before:
            return True
        pace = self.pace
        if pace is None or not all(other.priced for other in (place, *before)):
            return False
        return all(pace.seconds(other.ahead + place.load) <= self._max_wait for other in before)

    def _within_wait(self, wait: float | None) -> float | None:
        """``wait`` (None: the pace is unknown), unless it is past ``max_wait``: then ``Overloaded``."""
        if wait is not None and wait > self._max_wait:
            raise self._refuse(
                f"the wait would be about {wait:.0f} s, over {self._max_wait:g} s", wait - self._max_wait
            )
        return wait

    def _refuse(self, why: str, over: float | None) -> Overloaded:
        """``over``: seconds of work past the bound, the time until there would be room (None: unknown)."""
        retry_after = min(_RETRY_AFTER[1], max(_RETRY_AFTER[0], _RETRY_AFTER[0] if over is None else over))
        return Overloaded(
            f"too many image requests: {why}; retry in {math.ceil(retry_after)} s",
            code="rate_limit_exceeded",
            retry_after=math.ceil(retry_after),
        )


def _before(place: AdmissionPlace, line: Iterable[AdmissionPlace]) -> Iterator[AdmissionPlace]:
    """The places in ``line`` before ``place``."""
    return itertools.takewhile(lambda other: other is not place, line)


def _over(wait: float | None, bound: float) -> float | None:
    return None if wait is None else wait - bound


def admitted_at_once(
    capacity: int, max_queued: int, max_wait: float, pace: Pace, load: Load, max_key_wait: float | None = None
) -> int:
    """How many requests of ``load`` each, arriving at once at an idle pair, admission takes at ``pace``: each
    waits for those before it, and the line holds ``max_queued`` beyond the slots; from one API key, no more
    than its share (``max_key_wait``) holds, and at least one."""
    each = pace.seconds(load)
    most = capacity + max_queued if each <= 0 else min(capacity + max_queued, math.floor(max_wait / each) + 1)
    if max_key_wait is not None and each > 0:
        most = min(most, max(1, math.floor(max_key_wait / each)))
    return most
