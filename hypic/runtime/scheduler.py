"""Continuous-batching scheduler: one engine thread serves many concurrent requests.

Each loop iteration:
    1. admit   waiting requests (bounded queue) while the running set has room (requests and tokens)
    2. prefill the admitted ones together: cold prefixes, all their cold segments in one varlen
               pass, one compose forward for all (engine.prefill), sample first tokens
    3. decode  one batched step for every running request (engine.step)
    4. retire  finished, cancelled and timed-out requests, releasing their state
Requests join and leave the running batch between steps. Only this thread touches the engine;
results reach the caller through the `on_event` callback (called from this thread). Other work on the engine or
its stores (the server's admin endpoints: listing, deleting, invalidating, clearing) is handed to this thread with
`call(fn)` and runs between two steps, never in the middle of a prefill or compose pass.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from .engine import Engine, Request


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should answer 429."""


class SchedulerClosedError(RuntimeError):
    """The scheduler is shutting down; the caller should answer 503."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_waiting: int = 256            # bounded queue
    max_running: int = 64             # requests decoding at once
    max_running_tokens: int = 1 << 20  # sum of (prompt + max_tokens) over running requests
    max_state_bytes: int = 0           # sum of the running requests' state bytes at their full length (prompt +
                                       # max_tokens; Engine.state_bytes); 0: no bound. One request alone is admitted
                                       # whatever its size
    max_prefill_batch: int = 16       # new requests prefilled together
    request_timeout_s: float = 600.0

    def __post_init__(self):
        from ..errors import ConfigError

        for name in ("max_waiting", "max_running", "max_running_tokens", "max_prefill_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_state_bytes, int) or self.max_state_bytes < 0:
            raise ConfigError(f"max_state_bytes must be an integer >= 0 (0: no bound), got {self.max_state_bytes!r}")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"request_timeout_s must be > 0, got {self.request_timeout_s!r}")


@dataclass(eq=False)
class Job:
    """A request as the scheduler sees it. `on_event(kind, job, payload)`, kind in
    "token" (payload: token id), "done" (payload: RequestOutput), "error" (payload: (status, msg))."""

    request: Request
    on_event: Callable
    id: int = field(default_factory=itertools.count().__next__)
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    first_token_at: float | None = None
    state_bytes: int = 0               # its states' bytes at full length (set at submission when the bound is on)

    @property
    def budget(self) -> int:
        return len(self.request.prompt) + self.request.params.max_tokens


class Scheduler:
    def __init__(self, engine: Engine, config: SchedulerConfig = SchedulerConfig()):
        self.engine = engine
        self.config = config
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="hypic-scheduler", daemon=True)
        self._calls: deque[tuple[Callable, Future]] = deque()
        self.steps = 0

    # -- caller side (any thread) ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def submit(self, job: Job) -> None:
        if self.config.max_state_bytes:
            job.state_bytes = self.engine.state_bytes(job.budget)
        with self._cv:
            if self._stop:
                raise SchedulerClosedError("the server is shutting down")
            if len(self.waiting) >= self.config.max_waiting:
                raise QueueFullError(f"too many waiting requests ({self.config.max_waiting}); retry later")
            self.waiting.append(job)
            self._cv.notify()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn() on the engine thread between two steps; the Future holds its result or its exception. Raises
        SchedulerClosedError when the scheduler is not running (nothing would run it)."""
        fut: Future = Future()
        with self._cv:
            if self._stop or not self._thread.is_alive():
                raise SchedulerClosedError("the engine thread is not running")
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    def cancel(self, job: Job) -> None:
        """Mark a job cancelled (client gone, stop string hit); it leaves at the next step boundary."""
        with self._cv:
            job.cancelled = True
            self._cv.notify()

    def stats(self) -> dict:
        with self._cv:
            running = list(self.running)
            return {"waiting": len(self.waiting), "running": len(running),
                    "running_tokens": sum(j.budget for j in running),
                    "request_state_bytes": sum(j.request.state.nbytes for j in running if j.request.state is not None),
                    "admitted_state_bytes": sum(j.state_bytes for j in running),
                    "steps": self.steps}

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for job in list(self.waiting) + list(self.running):
            job.on_event("error", job, (503, "the server shut down before the request finished"))
        self.waiting.clear()
        self.running.clear()
        with self._cv:
            calls, self._calls = list(self._calls), deque()
        for _, fut in calls:
            fut.set_exception(SchedulerClosedError("the server shut down before the call ran"))

    # -- engine thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.waiting and not self.running and not self._calls:
                    self._cv.wait(0.5)
                if self._stop:
                    return
                calls, self._calls = list(self._calls), deque()
                admitted = self._admit()
            for fn, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:      # the caller gets it; the engine thread goes on
                        fut.set_exception(e)
            if admitted:
                self._prefill(admitted)
            self._retire()
            if self.running:
                self._decode()
                self._retire()

    def _admit(self) -> list[Job]:
        now, out = time.monotonic(), []
        tokens = sum(j.budget for j in self.running)
        held = sum(j.state_bytes for j in self.running)
        while self.waiting and len(out) < self.config.max_prefill_batch:
            job = self.waiting[0]
            if job.cancelled or now - job.arrival > self.config.request_timeout_s:
                self.waiting.popleft()
                if not job.cancelled:
                    job.on_event("error", job, (504, "the request timed out in the queue"))
                continue
            if self.running or out:
                if len(self.running) + len(out) >= self.config.max_running:
                    break
                if tokens + job.budget > self.config.max_running_tokens:
                    break
                if self.config.max_state_bytes and held + job.state_bytes > self.config.max_state_bytes:
                    break
            self.waiting.popleft()
            tokens += job.budget
            held += job.state_bytes
            out.append(job)
        return out

    def _prefill(self, jobs: list[Job]) -> None:
        groups: dict[bool, list[Job]] = {}
        for j in jobs:
            groups.setdefault(j.request.policy.exact_transition, []).append(j)
        for group in groups.values():
            reqs = [j.request for j in group]
            t0 = time.perf_counter()
            for r in reqs:
                r.t_start = t0
            try:
                logits = self.engine.prefill(reqs, defer_state=True)
                tokens = [self.engine.accept(j.request, row) for j, row in zip(group, logits)]
                now = time.perf_counter()
                self.engine.settle(reqs)           # the states of the requests that go on decoding
            except Exception as e:  # a bug or OOM fails these requests, not the server
                for j in group:
                    j.request.state = None
                    j.on_event("error", j, (500, f"prefill failed: {type(e).__name__}: {e}"))
                continue
            for j, tok in zip(group, tokens):
                j.request.ttft_s = now - _to_perf(j.arrival)      # queueing included
                j.first_token_at = time.monotonic()
                self._emit(j, tok)
                with self._cv:
                    self.running.append(j)

    def _decode(self) -> None:
        batch = [j for j in self.running if not j.cancelled and not j.request.finished]
        if not batch:
            return
        try:
            logits = self.engine.step([j.request for j in batch])
        except Exception as e:
            for j in batch:
                j.cancelled = True
                j.on_event("error", j, (500, f"decode failed: {type(e).__name__}: {e}"))
            return
        self.steps += 1
        for j, row in zip(batch, logits):
            self._emit(j, self.engine.accept(j.request, row))

    def _emit(self, job: Job, token: int) -> None:
        if not job.cancelled:
            job.on_event("token", job, token)

    def _retire(self) -> None:
        now = time.monotonic()
        keep = []
        for j in self.running:
            r = j.request
            if j.cancelled:
                r.state = None
            elif r.finished:
                j.on_event("done", j, self.engine.finish(r))
            elif now - j.arrival > self.config.request_timeout_s:
                r.state = None
                j.on_event("error", j, (504, f"the request exceeded {self.config.request_timeout_s:g} s"))
            else:
                keep.append(j)
        with self._cv:
            self.running = keep


def _to_perf(monotonic_t: float) -> float:
    """Convert a time.monotonic() stamp to the perf_counter clock (TTFT counts queueing)."""
    return time.perf_counter() - (time.monotonic() - monotonic_t)
