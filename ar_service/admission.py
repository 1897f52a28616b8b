"""Admission of image requests against the capacity of the whole AR+DiT pair, decided at arrival, priced
by the work each request asks for.

A request is admitted once, here, before any engine work. At most ``capacity`` requests are in
flight, where ``capacity`` is what the DiTs announced they hold (``DitCapacity.max_outstanding``):
the AR never prefills a request the DiTs have no room for. A request beyond that waits in line,
first come first served.

Each request is priced by what it asks (its ``Load``: one request, the megapixels of its images, its
denoising work) at the pair's pace (``Pace``: seconds for each of those). A request's wait before its
render starts is what everything admitted before it and not yet finished (in flight, and in line) costs
at that pace: it is admitted if that fits ``max_wait``, and refused with 429 at once otherwise, with
``Retry-After`` the time until it would fit. So a request admitted is served within the promise, however
heavy the requests ahead of it, and one that is not waits for nothing. A request admitted to the line leaves
it only to start, or when its client leaves.

The DiTs measure the pace's parts in their warm-up (``DitCapabilities.pace``): that prices a fresh pair's
first burst by what it costs. The pair's own pace is measured as it completes requests: the time between
completions over the last ``_WINDOW`` of them, preferring those that ended while others waited in line (the
rate at which a line moves), against what the warm-up pace says they cost; the warm-up pace scaled by that
ratio is the pace. The scale is what one render alone on an idle DiT cannot tell (the AR's engine, batches,
a busy machine); the split is what a window of requests all of one size cannot. A DiT that announces no pace
leaves the split to the work alone, and the pace unknown until a completion: then one round of ``capacity``
requests may wait, the rest are refused.

A request takes its place at arrival, before its body is parsed (``AdmissionDoor``), priced as the DiTs' default
request, or as the requests read lately asked on average where that is lighter (``unread_load``: a model's default
can be many times what its users ask, and a burst of small requests priced at it would be refused at the door for
work nobody asked for); once validated, serving prices it as what it really asks (``AdmissionPlace.price``), which is
what the requests after it are priced against. Requests of a burst all arrive before the first is priced, so
each is checked again when it is: if the requests before it, at their real prices, would hold its render past
``max_wait``, it is refused then (429, before any work), not admitted past the promise. With API keys, one
key's requests in flight and in line, itself included, may hold at most ``max_key_wait`` of work at that pace
(its share; one request a key may always have, however heavy): past that, that key's request is refused when
priced, so a key that floods the line delays another key's request by at most its share (FIFO is kept: a fair
queue that let newcomers pass would break the promise made to those already admitted). Its place then travels
with the request to serving, which waits for its turn (``AdmissionPlace.turn``); a place given up before its
turn lets the line move on.

Everything runs on the event loop thread, so plain counters and futures are enough.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

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

    def __init__(self, admission: RequestAdmission, turn: asyncio.Future[None], load: Load) -> None:
        self._admission = admission
        self._turn = turn
        self.load = load
        self.tenant: str | None = None  # whose API key, once priced
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
        against it. ``Overloaded`` when the requests before it, at their prices, would hold its render past the
        wait promised, or its key's requests, with it, would hold more than the key's share."""
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

    @property
    def in_flight(self) -> int:
        return self._running

    def enter(self, capacity: int, load: Load, announced_pace: Pace | None = None) -> AdmissionPlace:
        """A slot among ``capacity`` now, or a place in line, for a request priced at ``load`` until it is
        priced again; ``Overloaded`` (429) at once when the line is full or the wait would be longer than
        ``max_wait``. ``announced_pace``: the DiTs' own, from their warm-up."""
        self._capacity = capacity
        if announced_pace is not None:
            self._announced = announced_pace
        if self._waiting and self._running < capacity:
            self._start_waiting()  # the DiTs announced more room since the last request
        wait = self.estimated_wait()
        if wait is not None and wait > self._max_wait:
            # A refusal is decided before anything is made for it: in a burst, most arrivals end here.
            raise self._refuse(
                f"the wait would be about {wait:.0f} s, over {self._max_wait:g} s", wait - self._max_wait
            )
        if self._running < capacity and not self._waiting:
            started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            started.set_result(None)
            place = AdmissionPlace(self, started, load)
            self._start(place)
            return place
        ahead = len(self._waiting)
        if ahead >= self._max_queued:
            raise self._refuse(f"the queue is full ({self._max_queued} requests wait)", _over(wait, self._max_wait))
        if wait is None and ahead >= capacity:
            raise self._refuse("the pace of this service is not measured yet; one round may wait", None)
        place = AdmissionPlace(self, asyncio.get_running_loop().create_future(), load)
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
        place.load = load
        place.tenant = tenant
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
            if tenant is not None and other.tenant == tenant:
                own += other.load  # before or after it: whichever order the bodies arrived in
        wait = pace.seconds(before)
        if wait > self._max_wait:
            raise self._refuse(
                f"the wait would be about {wait:.0f} s, over {self._max_wait:g} s", wait - self._max_wait
            )
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
        self._running += 1
        self._count(place)
        if self._busy_since is None:
            self._busy_since = time.monotonic()
        self._metrics.requests_in_flight.set(self._running)

    def _start_waiting(self) -> None:
        while self._waiting and self._running < self._capacity:
            place = self._waiting.popleft()
            if place.in_line:
                self._start(place)
                place.start()
        self._metrics.requests_in_flight.set(self._running)
        self._metrics.requests_queued.set(len(self._waiting))

    def _refuse(self, why: str, over: float | None) -> Overloaded:
        """``over``: seconds of work past the bound, the time until there would be room (None: unknown)."""
        retry_after = min(_RETRY_AFTER[1], max(_RETRY_AFTER[0], _RETRY_AFTER[0] if over is None else over))
        return Overloaded(
            f"too many image requests: {why}; retry in {math.ceil(retry_after)} s",
            code="rate_limit_exceeded",
            retry_after=math.ceil(retry_after),
        )


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
