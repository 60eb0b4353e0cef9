"""The store contract every cache tier implements, and the in-memory tier.

Contract (SegmentStore):
    get(key)       -> value or None. A hit marks the value most recently used.
    put(key, v)    -> True if admitted. May evict least-recently-used values to make room; a value
                      larger than the whole budget is refused (False) and nothing is evicted.
    delete(key)    -> True if it was present.
    clear()        drops everything (counts as no evictions).
Values are immutable once stored and carry `nbytes`. A request that got a value keeps a Python
reference for its lifetime, so eviction never frees memory under a running request; the bytes
are released when the last request lets go.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Hashable, Iterator, Protocol


@dataclass
class StoreStats:
    entries: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    hits: int = 0
    misses: int = 0
    insertions: int = 0
    evictions: int = 0
    rejected: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class SegmentStore(Protocol):
    def get(self, key: Hashable) -> Any | None: ...
    def put(self, key: Hashable, value: Any) -> bool: ...
    def delete(self, key: Hashable) -> bool: ...
    def clear(self, counters: bool = False) -> None: ...
    def stats(self) -> StoreStats: ...
    def keys(self) -> Iterator[Hashable]: ...
    def __contains__(self, key: Hashable) -> bool: ...
    def __len__(self) -> int: ...


class MemoryStore:
    """Values under a byte budget, thread safe. Eviction: least recently used, or with `cost` (value -> the work its
    reuse saves, e.g. prefill FLOPs) GreedyDual-Size: each value's priority is L + cost / bytes, set when it is stored
    or hit, L being the priority of the last value evicted; the lowest priority goes first (ties: the least recent).
    It keeps what saves the most work per byte and still ages out what is not used (L rises with every eviction).
    on_evict(key, value), if given, is called for every value evicted to make room (not for delete / clear / a
    refused put), after the store's lock is released: a tiered store moves it down."""

    def __init__(self, capacity_bytes: int, on_evict=None, cost=None):
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = StoreStats(capacity_bytes=capacity_bytes)
        self._on_evict = on_evict
        self._cost = cost
        self._prio: dict[Hashable, float] = {}
        self._clock = 0.0

    def _touch(self, key, value) -> None:
        if self._cost is not None:
            self._prio[key] = self._clock + self._cost(value) / max(value.nbytes, 1)

    def _victim(self):
        """The key to evict next (the store is not empty)."""
        if self._cost is None:
            return next(iter(self._data))
        best = None
        for k in self._data:                       # oldest first: a tie keeps the least recent
            if best is None or self._prio[k] < self._prio[best]:
                best = k
        self._clock = self._prio[best]
        return best

    def _evict_to(self, limit: int) -> list:
        """Evicts (under the lock) until the entries hold at most `limit` bytes; returns the (key, value) pairs."""
        evicted = []
        while self._data and self._stats.bytes > limit:
            ek = self._victim()
            ev = self._data.pop(ek)
            self._prio.pop(ek, None)
            self._stats.bytes -= ev.nbytes
            self._stats.evictions += 1
            evicted.append((ek, ev))
        return evicted

    def _report(self, evicted: list) -> None:
        """on_evict for each (key, value) evicted, called after the lock is released."""
        if self._on_evict is not None:
            for ek, ev in evicted:
                self._on_evict(ek, ev)

    def get(self, key):
        with self._lock:
            v = self._data.get(key)
            if v is None:
                self._stats.misses += 1
                return None
            self._data.move_to_end(key)
            self._touch(key, v)
            self._stats.hits += 1
            return v

    def peek(self, key):
        """Like get, without touching recency or hit counters."""
        with self._lock:
            return self._data.get(key)

    def put(self, key, value) -> bool:
        size = value.nbytes
        with self._lock:
            cap = self._stats.capacity_bytes
            if size > cap:
                self._stats.rejected += 1
                return False
            old = self._data.pop(key, None)
            if old is not None:
                self._stats.bytes -= old.nbytes
            evicted = self._evict_to(cap - size)
            self._data[key] = value
            self._touch(key, value)
            self._stats.bytes += size
            self._stats.insertions += 1
        self._report(evicted)
        return True

    def set_capacity(self, capacity_bytes: int) -> int:
        """A new byte budget, the entries over it evicted as by put (on_evict called for each); returns how many went.
        (An operator's bound on a running engine's cache, e.g. to leave a smaller card room for its forwards.)"""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        with self._lock:
            self._stats.capacity_bytes = capacity_bytes
            evicted = self._evict_to(capacity_bytes)
        self._report(evicted)
        return len(evicted)

    def pop(self, key):
        """Removes and returns the value (None if absent), without counting a hit or a miss."""
        with self._lock:
            v = self._data.pop(key, None)
            if v is not None:
                self._prio.pop(key, None)
                self._stats.bytes -= v.nbytes
            return v

    def delete(self, key) -> bool:
        return self.pop(key) is not None

    def clear(self, counters: bool = False) -> None:
        """Drops every entry; with counters, also the hit / miss / insertion / eviction counts."""
        with self._lock:
            self._data.clear()
            self._prio.clear()
            self._stats.bytes = 0
            if counters:
                self._stats = StoreStats(capacity_bytes=self._stats.capacity_bytes)

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**asdict(self._stats))
            s.entries = len(self._data)
            return s

    def keys(self):
        with self._lock:
            return list(self._data.keys())

    def values(self):
        with self._lock:
            return list(self._data.values())

    def items(self):
        with self._lock:
            return list(self._data.items())

    def check(self) -> None:
        """Integrity: accounted bytes equal the sum of entry sizes and fit the budget."""
        with self._lock:
            total = sum(v.nbytes for v in self._data.values())
            assert total == self._stats.bytes, (total, self._stats.bytes)
            assert self._cost is None or self._prio.keys() == self._data.keys()
            assert total <= self._stats.capacity_bytes

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


class Doorkeeper:
    """Admission "repeat" (EngineConfig.admission): a key is admitted from its second sighting among the last
    `window` distinct keys seen once (oldest forgotten first), so a one-off segment is never stored. Thread safe."""

    def __init__(self, window: int):
        self.window = window
        self._seen: OrderedDict[Hashable, bool] = OrderedDict()
        self._lock = threading.Lock()
        self.deferred = 0                  # sightings not admitted

    def admit(self, key: Hashable) -> bool:
        with self._lock:
            if self._seen.pop(key, None) is not None:
                return True
            self._seen[key] = True
            if len(self._seen) > self.window:
                self._seen.popitem(last=False)
            self.deferred += 1
            return False
