"""The segment store's tiers below the engine's device: pinned host memory and disk, behind the same contract
(cache/store.py SegmentStore).

    TieredStore   device tier (a MemoryStore of SegmentEntry on the engine's device)
                    | evicted -> host tier, if any      ^ a hit below is promoted back (copied to the device)
                  host tier (a MemoryStore of PackedEntry: one byte buffer per entry, pinned on CUDA)
                    | evicted -> dropped (the disk tier has it, if any)
                  disk tier (DiskStore: one safetensors file per entry, written through in the background)

An entry below the device tier is a PackedEntry (cache/wire.py: the entry's tensors in one uint8 buffer plus its
description), so moving it between tiers is one copy of one buffer. The disk tier persists across restarts: a new
engine on the same directory finds the entries of the same model (keys carry the model's fingerprint, namespace,
ids' digest, seam and anchor). Every file carries the sha256 of its bytes, checked when it is read: a file that does
not match is deleted and counts as a miss (`corrupt`), never served.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from .entry import SegmentEntry, SegmentKey
from .store import MemoryStore, StoreStats
from .wire import meta_from_json, meta_to_json, pack, unpack

log = logging.getLogger("hypic.cache")


@dataclass(frozen=True)
class PackedEntry:
    """A SegmentEntry as bytes (wire.pack): what the host and disk tiers hold."""

    meta: dict
    payload: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.payload.numel())

    @property
    def length(self) -> int:
        return self.meta["length"]

    @property
    def origin(self) -> int:
        return self.meta["origin"]

    @classmethod
    def of(cls, entry: SegmentEntry, pin: bool) -> "PackedEntry":
        """pin: the bytes in page-locked host memory (a CUDA engine's host tier: copies back to the GPU at full
        speed, asynchronously)."""
        meta, payload = pack(entry)
        if pin:
            host = torch.empty(payload.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(payload)
            return cls(meta, host)
        return cls(meta, payload.cpu())

    def entry(self, device: torch.device) -> SegmentEntry:
        return unpack(self.meta, self.payload.to(device, non_blocking=self.payload.is_pinned()))

    def digest(self) -> str:
        return hashlib.sha256(memoryview(self.payload.numpy())).hexdigest()


@dataclass
class DiskStats(StoreStats):
    corrupt: int = 0                   # files whose bytes did not match their checksum (deleted)
    write_errors: int = 0


class DiskStore:
    """Entries as `<key id>.safetensors` in one directory, LRU under a byte budget (recency in memory, from the
    files' modification times at start-up). Writes go through a background thread (put returns once the entry is
    queued; `flush` waits); reads are synchronous and verified. Thread safe."""

    SUFFIX = ".safetensors"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._stats = DiskStats(capacity_bytes=capacity_bytes)
        self._index: dict[str, tuple[int, float]] = {}          # key id -> (bytes on disk, last use)
        self._keys: dict[str, SegmentKey] = {}                  # key id -> key, for files written or read here
        for f in self.dir.glob("*" + self.SUFFIX):
            st = f.stat()
            self._index[f.name[: -len(self.SUFFIX)]] = (st.st_size, st.st_mtime)
        for f in self.dir.glob("*.tmp"):                      # a write cut short by a crash
            f.unlink(missing_ok=True)
        self._stats.bytes = sum(n for n, _ in self._index.values())
        self._q: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="hypic-disk-writer", daemon=True)
        self._writer.start()
        atexit.register(_flush_at_exit, weakref.ref(self))   # queued writes land before the interpreter exits

    def _path(self, kid: str) -> Path:
        return self.dir / (kid + self.SUFFIX)

    # -- writes ------------------------------------------------------------------------------------------
    def put(self, key: SegmentKey, packed: PackedEntry) -> bool:
        if packed.nbytes > self._stats.capacity_bytes:
            with self._lock:
                self._stats.rejected += 1
            return False
        self._q.put((key.id, packed))
        with self._lock:
            self._keys[key.id] = key
        return True

    def flush(self) -> None:
        """Waits until every queued write is on disk."""
        self._q.join()

    def _write_loop(self) -> None:
        from safetensors.torch import save_file

        while True:
            kid, packed = self._q.get()
            try:
                meta = {"hypic_entry": meta_to_json(packed.meta), "sha256": packed.digest()}
                tmp = self.dir / (kid + ".tmp")
                save_file({"payload": packed.payload}, str(tmp), metadata=meta)
                size = tmp.stat().st_size
                with self._lock:
                    os.replace(tmp, self._path(kid))      # atomic: a reader sees the old file or the new one
                    old = self._index.pop(kid, None)
                    if old is not None:
                        self._stats.bytes -= old[0]
                    self._index[kid] = (size, time.time())
                    self._stats.bytes += size
                    self._stats.insertions += 1
                    self._evict_locked()
            except Exception as e:                        # a full disk loses the entry's copy there, nothing else
                log.warning("could not write cache entry %s: %r", kid, e)
                with self._lock:
                    self._stats.write_errors += 1
            finally:
                self._q.task_done()

    def _evict_locked(self) -> None:
        while self._stats.bytes > self._stats.capacity_bytes and self._index:
            kid = min(self._index, key=lambda k: self._index[k][1])
            self._drop_locked(kid)
            self._stats.evictions += 1

    def _drop_locked(self, kid: str) -> None:
        size, _ = self._index.pop(kid)
        self._keys.pop(kid, None)
        self._stats.bytes -= size
        self._path(kid).unlink(missing_ok=True)

    def _key_locked(self, kid: str) -> SegmentKey | None:
        """The key of a file on disk: known if written or read here, else read from its header (a file from an
        earlier run); None if the header cannot be read."""
        if kid not in self._keys:
            from safetensors import safe_open

            try:
                with safe_open(str(self._path(kid)), framework="pt") as fh:
                    self._keys[kid] = meta_from_json((fh.metadata() or {})["hypic_entry"])["key"]
            except Exception:
                return None
        return self._keys[kid]

    def delete_where(self, match) -> list[str]:
        """Deletes every entry whose key satisfies match(key) (a file whose header cannot be read is kept: get
        verifies it); returns their key ids."""
        self.flush()
        with self._lock:
            gone = [kid for kid in self._index if (k := self._key_locked(kid)) is not None and match(k)]
            for kid in gone:
                self._drop_locked(kid)
            return gone

    # -- reads -------------------------------------------------------------------------------------------
    def get(self, key: SegmentKey) -> PackedEntry | None:
        from safetensors import safe_open

        kid = key.id
        with self._lock:
            if kid not in self._index:
                self._stats.misses += 1
                return None
            try:
                with safe_open(str(self._path(kid)), framework="pt") as fh:
                    header = fh.metadata() or {}
                    payload = fh.get_tensor("payload")
                meta = meta_from_json(header["hypic_entry"])
                packed = PackedEntry(meta, payload)
                ok = header.get("sha256") == packed.digest() and meta["key"] == key and meta["nbytes"] == packed.nbytes
            except Exception as e:
                log.warning("unreadable cache entry %s: %r", kid, e)
                ok = False
            if not ok:
                self._drop_locked(kid)
                self._stats.corrupt += 1
                self._stats.misses += 1
                return None
            self._index[kid] = (self._index[kid][0], time.time())
            self._keys[kid] = key
            self._stats.hits += 1
            return packed

    def delete(self, key: SegmentKey) -> bool:
        return self.delete_id(key.id)

    def delete_id(self, kid: str) -> bool:
        self.flush()
        with self._lock:
            if kid not in self._index:
                return False
            self._drop_locked(kid)
            return True

    def clear(self, counters: bool = False) -> None:
        self.flush()
        with self._lock:
            for kid in list(self._index):
                self._drop_locked(kid)
            if counters:
                self._stats = DiskStats(capacity_bytes=self._stats.capacity_bytes)

    def __contains__(self, key: SegmentKey) -> bool:
        with self._lock:
            return key.id in self._index

    def stats(self) -> DiskStats:
        with self._lock:
            s = DiskStats(**self._stats.as_dict())
            s.entries = len(self._index)
            return s

    def check(self) -> None:
        """Integrity: the index matches the files, the accounted bytes their sizes, within the budget."""
        self.flush()
        with self._lock:
            on_disk = {f.name[: -len(self.SUFFIX)]: f.stat().st_size for f in self.dir.glob("*" + self.SUFFIX)}
            assert on_disk == {k: n for k, (n, _) in self._index.items()}, (sorted(on_disk), sorted(self._index))
            assert self._stats.bytes == sum(on_disk.values()) <= self._stats.capacity_bytes


def _flush_at_exit(ref) -> None:
    store = ref()
    if store is not None:
        store.flush()


class TieredStore:
    """The SegmentStore contract over a device tier, an optional host tier and an optional disk tier (module doc).
    get(key) returns a SegmentEntry on the device; a hit below the device tier copies the entry up and counts as a
    hit of the tier that held it. put(key, entry) stores it on the device and writes it through to disk.
    delete / clear act on every tier (clear also deletes the disk tier's files)."""

    def __init__(self, device: torch.device, device_bytes: int, host_bytes: int = 0, disk_dir: str | None = None,
                 disk_bytes: int = 0, cost=None):
        """cost: None (LRU) or SegmentEntry -> the prefill work its reuse saves (GreedyDual-Size in the device and host
        tiers; a PackedEntry is costed from its description's length and origin, the same figure)."""
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._lock = threading.RLock()
        self.host = MemoryStore(host_bytes, cost=cost) if host_bytes > 0 else None
        self.disk = DiskStore(disk_dir, disk_bytes) if disk_dir else None
        self.mem = MemoryStore(device_bytes, on_evict=self._demote if self.host is not None else None, cost=cost)
        self.promotions = {"host": 0, "disk": 0}

    def _demote(self, key, entry: SegmentEntry) -> None:
        self.host.put(key, PackedEntry.of(entry, self._pin))

    # -- the contract ------------------------------------------------------------------------------------
    def get(self, key):
        with self._lock:
            v = self.mem.get(key)
            if v is not None:
                return v
            packed, src = None, None
            if self.host is not None and (packed := self.host.get(key)) is not None:
                self.host.pop(key)                    # it moves up: one copy of an entry below the device at most
                src = "host"
            elif self.disk is not None and (packed := self.disk.get(key)) is not None:
                src = "disk"
            if packed is None:
                return None
            entry = packed.entry(self.device)
            self.mem.put(key, entry)                  # may move others down to the host tier
            self.promotions[src] += 1
            return entry

    def put(self, key, entry: SegmentEntry) -> bool:
        with self._lock:
            ok = self.mem.put(key, entry)
            if self.host is not None:
                self.host.pop(key)                    # the device copy is the current one
        if self.disk is not None and key not in self.disk:
            self.disk.put(key, PackedEntry.of(entry, pin=False))
        return ok

    def delete(self, key) -> bool:
        with self._lock:
            found = self.mem.delete(key)
            if self.host is not None:
                found = self.host.delete(key) or found
            if self.disk is not None:
                found = self.disk.delete(key) or found
            return found

    def delete_id(self, kid: str) -> bool:
        """Deletes the entry whose SegmentKey.id is `kid` from every tier (the admin endpoint's handle)."""
        with self._lock:
            found = False
            for tier in (self.mem, self.host):
                if tier is not None:
                    for k in tier.keys():
                        if k.id == kid:
                            found = tier.delete(k) or found
            if self.disk is not None:
                found = self.disk.delete_id(kid) or found
            return found

    def delete_where(self, match) -> int:
        """Deletes every entry whose SegmentKey satisfies match(key) from every tier (invalidation by document,
        version or namespace); returns how many entries went (an entry held by two tiers counts once)."""
        with self._lock:
            gone = set()
            for tier in (self.mem, self.host):
                if tier is not None:
                    for k in [k for k in tier.keys() if match(k)]:
                        if tier.delete(k):
                            gone.add(k.id)
            if self.disk is not None:
                gone.update(self.disk.delete_where(match))
            return len(gone)

    def clear(self, counters: bool = False) -> None:
        with self._lock:
            for tier in (self.mem, self.host, self.disk):
                if tier is not None:
                    tier.clear(counters)
            if counters:
                self.promotions = {"host": 0, "disk": 0}

    def stats(self) -> StoreStats:
        return self.mem.stats()

    def tier_stats(self) -> dict:
        """Each tier's figures by name: "segments" (the device tier), "segments_host", "segments_disk"."""
        out = {"segments": self.mem.stats().as_dict()}
        if self.host is not None:
            out["segments_host"] = self.host.stats().as_dict()
        if self.disk is not None:
            out["segments_disk"] = self.disk.stats().as_dict()
        return out

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def keys(self):
        return self.mem.keys()

    def values(self):
        return self.mem.values()

    def check(self) -> None:
        self.mem.check()
        if self.host is not None:
            self.host.check()
        if self.disk is not None:
            self.disk.check()

    def __contains__(self, key) -> bool:
        return key in self.mem or (self.host is not None and key in self.host) or (
            self.disk is not None and key in self.disk)

    def __len__(self) -> int:
        return len(self.mem)
