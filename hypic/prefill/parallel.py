"""Segment-parallel cold prefill (hypic.md 2.3): the cold segments of a request prefilled on several ranks at once.

A PIC segment's entry depends only on its own tokens (and its anchor's), so the cold segments of one prefill can be
computed anywhere that holds the same weights and combined afterwards: O(ceil(n/m) |C| + c) instead of O(n |C|).

    rank 0 (the engine, this process)            ranks 1..m-1 (`serve`, one process each, own copy of the model)
    ------------------------------------         ------------------------------------------------------------
    place segments longest-first (LPT)
    send each worker its order          ---->    prefill the order in batches (prefill/isolated.py, the same code)
    prefill its own share meanwhile              send each entry as soon as its batch is done
    a receiver thread takes entries     <----    (header and description over gloo, bytes over gloo or NCCL)
      in the order they come
    wait for the rest until the deadline; whatever failed or is late is prefilled on rank 0

Which rank owns what: the model, the caches and every request live on rank 0; a worker holds only its model and the
batch it is working on. Entries are built by the same function on every rank, so where a segment was prefilled does
not change what is cached (rank 0's output equals a one-rank engine's; tests/test_parallel.py).

Messages (rank 0 <-> worker r, in order per pair):
    header  int64 [4] = (kind, sender rank, order seq, description bytes)   control group, TAG_HDR
    description  pickled dict, uint8 [n]                                    control group, TAG_META
    payload (ENTRY only)  uint8 [nbytes] (cache/wire.py)                  data group, TAG_DATA
The receiver thread posts one receive from any source at a time; a worker that dies or stalls does not block it, and
a late worker's entries, when they come, are recognised by their order seq and dropped; until then the worker is
given no new order.

Restarts (spawned workers, `ParallelConfig.restarts`): a process group cannot take a rank back, so the ranks move to a
new one. At the start of a prefill rank 0 starts a new process for each worker that died (its model loads in the
background; the others go on serving); once every rank is up and none owes entries, rank 0 sends the live workers
REGROUP, each acknowledges over the old group and all ranks build the groups of the next generation (store prefixes
ctl/<gen>, data/<gen>). A worker that failed mid-message (alive but cut off) is stopped and started again the same
way. A worker started by hand (`hypic worker`, other hosts) counts its starts in the store: when its operator starts
it again for a rank that died, rank 0 sees the new start and takes it back the same way. If forming the new group
fails, every worker is stopped and rank 0 prefills alone from then on.
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing
import pickle
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..config import EngineConfig, ParallelConfig
from ..errors import WorkerError
from .placement import chunks, lpt, round_robin, segment_cost

log = logging.getLogger("hypic.parallel")

ORDER, STOP, ENTRY, ERROR, REGROUP = 1, 2, 3, 4, 5
TAG_HDR, TAG_META, TAG_DATA = 11, 12, 13
_FOREVER = datetime.timedelta(days=3650)


def _store(pc: ParallelConfig, master: bool, port: int | None = None):
    import torch.distributed as dist

    return dist.TCPStore(pc.host, pc.port if port is None else port, pc.workers, master,
                         timeout=datetime.timedelta(seconds=pc.startup_timeout_s), wait_for_workers=False)


def _groups(store, rank: int, pc: ParallelConfig, transport: str, timeout: datetime.timedelta, gen: int = 0):
    """(control, data) process groups of this rank in generation `gen`, made directly (no default group: the user's
    own use of torch.distributed in this process is left alone)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # ranks on one host (spawned, or a loopback rendezvous) talk over the loopback device, with no dependence on the
    # host name resolving; ranks on several hosts use the device gloo picks for this host's name
    local = pc.spawn or pc.host in ("127.0.0.1", "localhost", "::1")
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if local
                     else dist.ProcessGroupGloo.create_default_device()]
    ctl = dist.ProcessGroupGloo(dist.PrefixStore(f"ctl/{gen}", store), rank, pc.workers, opts)
    if transport == "gloo":
        return ctl, ctl
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ctl, dist.ProcessGroupNCCL(dist.PrefixStore(f"data/{gen}", store), rank, pc.workers, opts)


def _send(ctl, data, dst: int, kind: int, rank: int, seq: int, desc: dict | None = None,
          payload: torch.Tensor | None = None) -> None:
    blob = pickle.dumps(desc) if desc is not None else b""
    ctl.send([torch.tensor([kind, rank, seq, len(blob)], dtype=torch.int64)], dst, TAG_HDR).wait()
    if blob:
        ctl.send([torch.frombuffer(bytearray(blob), dtype=torch.uint8)], dst, TAG_META).wait()
    if payload is not None:
        data.send([payload], dst, TAG_DATA).wait()


def _recv_desc(ctl, src: int, n: int) -> dict | None:
    if not n:
        return None
    buf = torch.empty(n, dtype=torch.uint8)
    ctl.recv([buf], src, TAG_META).wait()
    return pickle.loads(buf.numpy().tobytes())


@dataclass
class WorkerStats:
    orders: int = 0                    # orders sent
    remote_segments: int = 0           # entries that came back from workers and were used
    remote_tokens: int = 0
    local_segments: int = 0            # segments rank 0 prefilled as its own share
    fallback_segments: int = 0         # segments a worker failed or was late with, prefilled on rank 0
    late_entries: int = 0              # entries that came after their deadline (dropped)
    received_bytes: int = 0
    errors: int = 0                    # orders a worker answered with an error
    restarts: int = 0                  # workers started again after they died, now serving

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Worker:
    rank: int
    device: str
    proc: object | None = None         # the spawned process, if this process started it
    pending: int = 0                   # entries of orders not yet answered (by an entry or an error)
    dead: bool = False
    late_seqs: set = field(default_factory=set)
    incarnation: int = 0               # how many times this rank's process was started again
    loading: object | None = None      # its next process, loading the model (not yet in the group)
    loaded: bool = False               # that process has said hello with the right fingerprint

    @property
    def usable(self) -> bool:
        return not self.dead and self.pending == 0 and (self.proc is None or self.proc.is_alive())


class SegmentWorkers:
    """Rank 0's side: starts (or waits for) the workers, places cold segments and collects their entries."""

    def __init__(self, loaded, config: EngineConfig, faults: dict[int, dict] | None = None):
        """faults: tests only, rank -> `serve`'s fault for that spawned worker."""
        pc = config.parallel
        if not pc.enabled:
            raise ValueError("SegmentWorkers needs ParallelConfig.workers > 1")
        self.pc, self.cfg = pc, loaded.config
        self.device = torch.device(config.device)
        self.transport = pc.data_transport(config.device)
        self.stats = WorkerStats()
        self.workers = [_Worker(r, pc.worker_device(r, config.device)) for r in range(1, pc.workers)]
        self._seq = 0
        self._closed = False
        self._q: queue.Queue = queue.Queue()
        self.gen = 0                                    # the groups' generation (restarts move every rank to a new one)
        self._acks: dict[int, set] = {}                 # generation -> workers whose REGROUP ack its receiver awaits
        self._old: list = []                            # earlier generations' groups (their receivers may still wait)
        self._source, self._config, self._fingerprint = loaded.source, config, loaded.fingerprint
        if pc.spawn and not (Path(self._source).is_dir() or _is_preset(self._source)):
            raise WorkerError(f"workers load the model themselves; {self._source!r} is neither a preset nor a directory")
        self._store = _store(pc, master=True)
        self.port = self._store.port
        self._procs: list = []                          # every process started (the finalizer stops them)
        if pc.spawn:
            for w in self.workers:
                w.proc = self._spawn(w, (faults or {}).get(w.rank))
        self._finalizer = weakref.finalize(self, _terminate, self._procs)
        try:
            self._handshake(loaded.fingerprint)
            self.ctl, self.data = _groups(self._store, 0, pc, self.transport, datetime.timedelta(seconds=pc.timeout_s))
        except BaseException:
            self._store.set("go/0", "stop")
            self._finalizer()
            raise
        self._rx = self._start_receiver()

    def _spawn(self, w: _Worker, fault: dict | None = None):
        ctx = multiprocessing.get_context("spawn")
        wcfg = self._config.replace(device=w.device, parallel=ParallelConfig())
        proc = ctx.Process(target=serve, args=(self._source, wcfg, w.rank, self.pc, self.port, fault, w.incarnation),
                           daemon=True, name=f"hypic-worker-{w.rank}" + (f".{w.incarnation}" if w.incarnation else ""))
        proc.start()
        self._procs.append(proc)
        return proc

    def _start_receiver(self) -> threading.Thread:
        rx = threading.Thread(target=self._receive, args=(self.ctl, self.gen), name=f"hypic-parallel-rx-{self.gen}",
                              daemon=True)
        rx.start()
        return rx

    # -- start-up ---------------------------------------------------------------------------------
    def _handshake(self, fingerprint: str) -> None:
        """Each worker reports (through the store) whether its model loaded and its fingerprint; all must match."""
        deadline = time.monotonic() + self.pc.startup_timeout_s
        hello = {}
        while len(hello) < len(self.workers):
            for w in self.workers:
                if w.rank in hello:
                    continue
                if self._store.check([f"hello/{w.rank}/0"]):
                    hello[w.rank] = json.loads(self._store.get(f"hello/{w.rank}/0"))
                elif w.proc is not None and not w.proc.is_alive():
                    raise WorkerError(f"worker {w.rank} exited with code {w.proc.exitcode} before it joined")
            if time.monotonic() > deadline:
                missing = [w.rank for w in self.workers if w.rank not in hello]
                raise WorkerError(f"workers {missing} did not join within {self.pc.startup_timeout_s} s "
                                  f"(rendezvous {self.pc.host}:{self.port})")
            time.sleep(0.02)
        for r, h in sorted(hello.items()):
            if h.get("error"):
                raise WorkerError(f"worker {r} could not start: {h['error']}")
            if h["fingerprint"] != fingerprint:
                raise WorkerError(f"worker {r} holds another model (fingerprint {h['fingerprint']} != {fingerprint}): "
                                  "same source, dtype, seed and load format on every rank")
        self._store.set("go/0", "run")

    # -- the receiver thread ----------------------------------------------------------------------
    def _receive(self, ctl, gen: int) -> None:
        """Takes whatever any worker sends over generation `gen`'s group, in the order it comes, and hands it to the
        main thread (tagged with gen). Ends when the group breaks, or after a regroup once every worker that was live
        in it has acknowledged."""
        while not self._closed:
            hdr = torch.zeros(4, dtype=torch.int64)
            try:
                ctl.recv_anysource([hdr], TAG_HDR).wait(_FOREVER)
            except Exception as e:                      # the group is gone (close) or broken
                if not self._closed:
                    self._q.put(("broken", 0, 0, repr(e), None, gen))
                return
            kind, rank, seq, n = (int(x) for x in hdr.tolist())
            if kind == REGROUP:                          # a worker leaves this group for the next one
                waiting = self._acks.get(gen)
                if waiting is not None:
                    waiting.discard(rank)
                    if not waiting:
                        return
                continue
            try:
                desc = _recv_desc(ctl, rank, n)
                payload = None
                if kind == ENTRY:
                    payload = self._recv_payload(rank, desc["entry"]["nbytes"], gen)
            except Exception as e:                      # the worker died in the middle of a message
                self._q.put(("dead", rank, seq, repr(e), None, gen))
                continue
            self._q.put((kind, rank, seq, desc, payload, gen))

    def _recv_payload(self, rank: int, nbytes: int, gen: int):
        data = self.data if gen == self.gen else None
        if data is None:
            raise WorkerError(f"an entry from generation {gen} after the move to {self.gen}")
        if self.transport == "gloo":
            buf = torch.empty(nbytes, dtype=torch.uint8)
            data.recv([buf], rank, TAG_DATA).wait()
            return buf
        stream = torch.cuda.Stream(self.device)             # this thread's own stream; the main thread waits on
        with torch.cuda.stream(stream):                     # the event before it reads the bytes
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            data.recv([buf], rank, TAG_DATA).wait()
            event = torch.cuda.Event()
            event.record(stream)
        return buf, event, stream

    def _payload(self, payload) -> torch.Tensor:
        if isinstance(payload, tuple):                      # NCCL: (bytes, event, stream)
            buf, event, _ = payload
            torch.cuda.current_stream(self.device).wait_event(event)
            buf.record_stream(torch.cuda.current_stream(self.device))
            return buf
        return payload.to(self.device)

    # -- one cold prefill -------------------------------------------------------------------------
    def prefill(self, slots: Sequence, starts: Sequence, local: Callable[[list[int]], list]) -> list:
        """Entries of `slots` (distinct cold SegmentSlots; starts[i] None unless slot i starts from a restored anchor
        state, which stays on rank 0). local(indices) prefills those slots here and returns their entries."""
        from ..cache.wire import unpack

        n = len(slots)
        entries: list = [None] * n
        self._drain(0.0)
        self._restart()
        ready = [w for w in self.workers if w.usable]
        movable = [i for i in range(n) if starts[i] is None]
        tokens = [len(s.anchor) + len(s.tokens) for s in slots]
        bins = (lpt([segment_cost(tokens[i], self.cfg) for i in movable], 1 + len(ready))
                if self.pc.placement == "lpt" else round_robin(len(movable), 1 + len(ready)))
        mine = sorted(set(range(n)) - set(movable) | {movable[j] for j in bins[0]})
        self._seq += 1
        seq = self._seq
        orders: dict[int, list[int]] = {}
        for w, b in zip(ready, bins[1:]):
            if not b:
                continue
            idx = [movable[j] for j in b]
            order = dict(seq=seq, chunk_tokens=self.pc.chunk_tokens,
                         slots=[(i, tuple(slots[i].tokens), slots[i].seam, slots[i].key, tuple(slots[i].anchor))
                                for i in idx])
            try:
                _send(self.ctl, self.data, w.rank, ORDER, 0, seq, order)
            except Exception as e:
                log.warning("worker %d is unreachable (%r); its segments go to rank 0", w.rank, e)
                w.dead = True
                mine += idx
                continue
            orders[w.rank] = idx
            w.pending += len(idx)
            self.stats.orders += 1
        for i, e in zip(mine, local(mine) if mine else []):
            entries[i] = e
        self.stats.local_segments += len(mine)
        want = {i for idx in orders.values() for i in idx}
        deadline = time.monotonic() + self.pc.timeout_s
        while want and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                kind, rank, s, desc, payload, gen = self._q.get(timeout=min(left, 0.05))
            except queue.Empty:                          # a spawned worker that died between messages sends nothing
                for r, idx in orders.items():
                    w = self.workers[r - 1]
                    if w.proc is not None and not w.proc.is_alive() and not w.dead:
                        log.warning("worker %d exited (code %s); its segments go to rank 0", r, w.proc.exitcode)
                        w.dead = True
                        want -= set(idx)
                continue
            if gen != self.gen:
                continue
            self._note(kind, rank, s, desc, payload, gen)
            if kind == "broken":
                want.clear()
            elif kind == "dead":
                want -= set(orders.get(rank, ()))
            elif s != seq:
                continue
            elif kind == ENTRY:
                i = desc["index"]
                if i not in want:
                    continue
                want.discard(i)
                if desc["entry"]["key"] != slots[i].key:    # not what was ordered: prefilled here instead
                    log.error("worker %d sent an entry for another key at index %d", rank, i)
                    continue
                entries[i] = unpack(desc["entry"], self._payload(payload))
                self.stats.remote_segments += 1
                self.stats.remote_tokens += len(slots[i].tokens)
            elif kind == ERROR:
                want -= set(desc["missing"])
        for w in self.workers:                           # whoever still owes entries of this order is late
            if w.rank in orders and any(i in want for i in orders[w.rank]):
                w.late_seqs.add(seq)
        missing = [i for i in range(n) if entries[i] is None]
        if missing:
            log.warning("%d of %d cold segments prefilled on rank 0 after their worker failed or was late",
                        len(missing), n)
            for i, e in zip(missing, local(missing)):
                entries[i] = e
            self.stats.fallback_segments += len(missing)
        return entries

    def _note(self, kind, rank: int, seq: int, desc, payload, gen: int) -> None:
        """Bookkeeping of one message from a worker, whichever order it belongs to (an earlier generation's: none)."""
        if gen != self.gen:
            return
        w = self.workers[rank - 1] if 1 <= rank <= len(self.workers) else None
        if kind == "broken":
            log.error("segment-parallel receiver stopped (%s); later cold prefills stay on rank 0", desc)
            for x in self.workers:
                x.dead = True
            return
        if w is None:
            return
        if kind == "dead":
            log.warning("worker %d failed mid-message (%s); it gets no more orders", rank, desc)
            w.dead = True
        elif kind == ENTRY:
            w.pending -= 1
            self.stats.received_bytes += desc["entry"]["nbytes"]
            if seq in w.late_seqs:
                self.stats.late_entries += 1
        elif kind == ERROR:
            w.pending -= len(desc["missing"])
            self.stats.errors += 1
            log.warning("worker %d could not prefill %d segments: %s", rank, len(desc["missing"]), desc["error"])
        if w.pending <= 0:
            w.late_seqs.clear()

    def _drain(self, wait_s: float) -> None:
        """Messages that came after their order's deadline: bookkeeping only (late workers get no new order until
        they have answered everything)."""
        while True:
            try:
                item = self._q.get(timeout=wait_s) if wait_s else self._q.get_nowait()
            except queue.Empty:
                return
            self._note(*item)

    # -- restarts ---------------------------------------------------------------------------------
    def _restart(self) -> None:
        """Starts a spawned worker that died again (its model loads in the background), or notices that a worker
        started by hand (`hypic worker`) was started anew for its rank; once every rank is up and no worker owes
        entries, moves all ranks to a new group (_regroup). Engine thread, between prefills."""
        if self._closed or (self.pc.spawn and self.pc.restarts == 0):
            return
        for w in self.workers:
            if not self.pc.spawn and w.loading is None:
                latest = int(self._store.add(f"incarnation/{w.rank}", 0)) - 1     # the rank's latest start
                if latest > w.incarnation:
                    log.warning("worker %d was started again by hand (start %d); it joins at the next regroup",
                                w.rank, latest)
                    w.dead, w.incarnation, w.loaded, w.loading = True, latest, False, _ByHand()
            if w.loading is not None:
                if not w.loaded and self._store.check([f"hello/{w.rank}/{w.incarnation}"]):
                    h = json.loads(self._store.get(f"hello/{w.rank}/{w.incarnation}"))
                    if h.get("error") or h.get("fingerprint") != self._fingerprint:
                        log.error("worker %d could not start again (%s); it stays out", w.rank,
                                  h.get("error") or "another model")
                        w.loading.terminate()
                        w.loading = None
                        continue
                    w.loaded = True
                elif not w.loading.is_alive():
                    log.warning("worker %d exited (code %s) while loading", w.rank, w.loading.exitcode)
                    w.loading = None
                continue
            if not self.pc.spawn:
                continue                                # a hand-started rank comes back when its operator starts it
            if w.dead and w.proc is not None and w.proc.is_alive():
                w.proc.terminate()                      # cut off mid-message: it gets no orders; start it anew
                w.proc.join(5)
            if w.proc is not None and not w.proc.is_alive() and w.incarnation < self.pc.restarts:
                w.dead = True
                w.incarnation += 1
                w.loaded = False
                w.loading = self._spawn(w)
                log.warning("worker %d exited (code %s); starting it again (%d of %d)", w.rank, w.proc.exitcode,
                            w.incarnation, self.pc.restarts)
        back = [w for w in self.workers if w.loading is not None]
        if not back or not all(w.loaded for w in back):
            return
        stay = [w for w in self.workers if w.loading is None]
        if any(w.dead or (w.proc is not None and not w.proc.is_alive()) or w.pending > 0 for w in stay):
            return                                      # a rank that will not come back, or one that owes entries
        self._regroup(stay, back)

    def _regroup(self, stay: list, back: list) -> None:
        g = self.gen + 1
        self._acks[self.gen] = {w.rank for w in stay}
        try:
            for w in stay:
                _send(self.ctl, self.data, w.rank, REGROUP, 0, 0, {"gen": g})
            for w in back:
                self._store.set(f"join/{w.rank}/{w.incarnation}", str(g))
            self._store.set(f"go/{g}", "run")
            ctl, data = _groups(self._store, 0, self.pc, self.transport, datetime.timedelta(seconds=self.pc.timeout_s),
                                g)                      # every rank is up and waiting for go/<g>: a quick connect
        except Exception as e:
            log.error("segment-parallel workers could not form a new group (%r); rank 0 prefills alone from now", e)
            self._store.set(f"go/{g}", "stop")
            for w in self.workers:
                w.dead = True
                for proc in (w.proc, w.loading):
                    if proc is not None and proc.is_alive():
                        proc.terminate()
                w.loading = None
            return
        self._old.append((self.ctl, self.data))
        self.gen, self.ctl, self.data = g, ctl, data
        for w in back:
            w.proc = None if isinstance(w.loading, _ByHand) else w.loading
            w.loading, w.loaded, w.dead, w.pending = None, False, False, 0
            w.late_seqs.clear()
        self.stats.restarts += len(back)
        self._rx = self._start_receiver()
        log.warning("workers %s started again; all ranks moved to group generation %d", [w.rank for w in back], g)

    # -- state and shutdown -----------------------------------------------------------------------
    def describe(self) -> dict:
        return {"workers": self.pc.workers, "transport": self.transport,
                "ready": [w.rank for w in self.workers if w.usable],
                "dead": [w.rank for w in self.workers if w.dead or (w.proc is not None and not w.proc.is_alive())],
                "late": [w.rank for w in self.workers if not w.dead and w.pending > 0],
                "restarting": [w.rank for w in self.workers if w.loading is not None], "generation": self.gen,
                **self.stats.as_dict()}

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops every live worker (they exit their loop) and the receiver; idempotent."""
        if self._closed:
            return
        for w in self.workers:
            if not w.dead and (w.proc is None or w.proc.is_alive()):
                try:
                    _send(self.ctl, self.data, w.rank, STOP, 0, 0)
                except Exception:
                    pass
        self._closed = True
        for w in self.workers:
            if w.loading is not None:                   # still loading, or waiting to join: told to stop
                self._store.set(f"join/{w.rank}/{w.incarnation}", "stop")
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()


class _ByHand:
    """Stands for a worker process started by hand elsewhere (`hypic worker`): nothing to watch or stop from here."""

    exitcode = None

    def is_alive(self) -> bool:
        return True

    def terminate(self) -> None:
        pass


def _terminate(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()


def _is_preset(source: str) -> bool:
    from ..models import presets

    return source in presets.PRESETS


# -- the worker's side --------------------------------------------------------------------------------
def _await_key(store, key: str) -> str | None:
    """The value of `key` once rank 0 sets it; None when rank 0 is gone (a spawned worker's parent, or the store)."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            if store.check([key]):
                return store.get(key).decode()
        except Exception:
            return None
        if parent is not None and not parent.is_alive():
            return None
        time.sleep(0.05)


def serve(source: str, config: EngineConfig, rank: int, pc: ParallelConfig, port: int | None = None,
          fault: dict | None = None, incarnation: int | None = None) -> None:
    """One worker: load the model, report to rank 0, then prefill orders until told to stop (or rank 0 is gone).
    config.device is this worker's device. fault: test-only misbehaviour on its k-th order (from 0), {"at": k,
    "do": "exit" | "sleep" | "raise", "seconds": s}. incarnation > 0: this rank started again after it died; it
    joins the group generation rank 0 names once every rank is up. None (a worker started by hand): counted in the
    store, so a `hypic worker` started again for a rank that died is taken back by rank 0."""
    from ..models.loader import load_model

    if pc.threads:
        torch.set_num_threads(pc.threads)
    store = _store(pc, master=False, port=port)
    if incarnation is None:
        incarnation = int(store.add(f"incarnation/{rank}", 1)) - 1
    try:
        if config.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(config.device))
        loaded = load_model(source, config)
        store.set(f"hello/{rank}/{incarnation}", json.dumps({"fingerprint": loaded.fingerprint,
                                                              "device": config.device}))
    except Exception as e:
        store.set(f"hello/{rank}/{incarnation}", json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return
    gen = _await_key(store, f"join/{rank}/{incarnation}") if incarnation else "0"
    if gen is None or gen == "stop":
        return
    gen = int(gen)
    state = {"done_orders": 0}
    while gen is not None:
        if _await_key(store, f"go/{gen}") != "run":       # rank 0 refused the group or is gone
            return
        gen = _serve_group(store, rank, pc, config, loaded, gen, fault, state)


def _serve_group(store, rank: int, pc: ParallelConfig, config: EngineConfig, loaded, gen: int, fault, state) -> int | None:
    """Orders over generation `gen`'s groups until STOP or rank 0 is gone (None), or REGROUP (the next generation)."""
    from ..plan.planner import SegmentSlot
    from .isolated import prefill_segments
    from ..cache.wire import pack

    device = torch.device(config.device)
    transport = pc.data_transport(config.device)
    ctl, data = _groups(store, rank, pc, transport, _FOREVER, gen)
    while True:
        hdr = torch.zeros(4, dtype=torch.int64)
        try:
            ctl.recv([hdr], 0, TAG_HDR).wait()
        except Exception:                     # rank 0 is gone
            return None
        kind, _, seq, n = (int(x) for x in hdr.tolist())
        if kind == STOP:
            return None
        order = _recv_desc(ctl, 0, n)
        if kind == REGROUP:
            try:
                _send(ctl, data, 0, REGROUP, rank, 0)    # wakes rank 0's receiver of this generation, which then ends
            except Exception:
                return None
            return int(order["gen"])
        done_orders = state["done_orders"]
        faulty = bool(fault) and done_orders == fault.get("at", 0)
        if faulty:
            if fault["do"] == "exit":
                import os

                os._exit(3)
            if fault["do"] == "sleep":
                time.sleep(fault["seconds"])
        items = order["slots"]
        slots = [SegmentSlot(toks, seam, key, anchor=anchor) for _, toks, seam, key, anchor in items]
        sent = set()
        try:
            if faulty and fault["do"] == "raise":
                raise RuntimeError("injected failure")
            tokens = [len(s.anchor) + len(s.tokens) for s in slots]
            for batch in chunks(range(len(slots)), tokens, order["chunk_tokens"]):
                entries = prefill_segments(loaded.model, [slots[j] for j in batch], device,
                                           max_tokens=order["chunk_tokens"])
                for j, entry in zip(batch, entries):
                    meta, payload = pack(entry)
                    if transport == "gloo":
                        payload = payload.cpu()
                    _send(ctl, data, 0, ENTRY, rank, seq, {"index": items[j][0], "entry": meta}, payload)
                    sent.add(j)
        except Exception as e:
            missing = [items[j][0] for j in range(len(items)) if j not in sent]
            try:
                _send(ctl, data, 0, ERROR, rank, seq, {"missing": missing, "error": f"{type(e).__name__}: {e}"})
            except Exception:
                return None
        state["done_orders"] = done_orders + 1
