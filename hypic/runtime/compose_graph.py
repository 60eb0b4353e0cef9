"""The compose pass of one request over fixed buffers, captured once per shape as a CUDA graph.

A warm `pic` request is a few hundred active tokens (seam windows, the query) around many cached
segments. The plain compose pass walks its pieces in Python in every layer: on a GPU it is
host-bound (thousands of launches, each a few microseconds of work). Here the request is lowered
once, on the host, to device tables, and the forward becomes a pure function of fixed buffers:

    tokens     ids, positions [Np]: the N active tokens, then Np - N >= 1 pad tokens
    runs       cu [R + 1]: the request's runs cut into pieces of at most SUB_RUN tokens (the fused
               recurrent kernel walks a run's tokens one after another: a 64-token query run
               costed 4x a seam window per layer; the chain composes the pieces exactly), then
               the pads' runs; run_of, pos_in_run [Np]
    chain      the maps in order: storage slots 0..E-1 hold the cached segments' (T, S), slots
               E..E+R-1 the runs' zero-start summaries (read where the kernel wrote them; with the Triton
               scan a run's T in factored form, rank <= 16: layers/linear.py RUN_FACTORS); order [E + R] lists
               the slots in sequence order, then the pad runs as a second chain from zero (cu_maps
               [0, E + R_real, E + R]): the first chain's final state is the request's, and every
               pad run gets a finite initial state without lengthening the request's chain; paired
               (layers/linear.py LOWRANK_PAIRS), each run followed by a cached map takes that map into
               its own (`pair_runs`), and cu_pairs bounds the shorter chains
    conv       one source buffer per linear layer: the initial window, the entries' tails packed,
               then the active raw inputs; conv_idx [Np, W] names each token's W inputs in it
    linear     the initial state [1, H, K, V] (the request's, after a cached prefix; else zero)
    attention  the keys the request holds already (a cached prefix, as attended) [P, Hkv, D], then
               the entries' position-free keys and values packed [Kc, Hkv, D] with their positions;
               a mask position per key (pads: never visible); the permutation kperm that puts the
               keys in position order, and per query the index of the last sorted key it sees (qlast)

Before a replay the request's tables are copied in (one host-to-device copy each) and its cached
tensors put in reach of the pass (each mixer's `compose_fill`: keys and values stacked into the fixed
buffers; linear maps named by address in a step table where the Triton scan runs, else stacked);
after it, the request's states are cut out of the pass's outputs (`compose_state`). Buckets (`ComposeShape`) keep
the number of distinct graphs small: tokens by 64, cached keys by eighths of a power of two; the
numbers of runs and entries are exact. Only what the lowering covers is taken: one request, exact
transitions, cached segments present, runs of at most 64 tokens, every stateful layer able to run
it (`graph_compose`: Gated DeltaNet, KDA and attention); anything else goes the planned walk. Pad queries
sit at position 0, where the request always has a key, so no softmax row is empty.
The same buffers run eagerly where graphs are off (CPU tests compare them with the plain pass). With
graphs, a shape is captured on its second request (`capture_after`); its first goes the planned way.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..ops.reference.gated_delta import CHUNK_MAX
from .batch import Apply, ForwardBatch, Run, SeqWork
from .graphs import capture_forward
from .trace import span
from .state import KVBuffer, LinearState

log = logging.getLogger("hypic.compose")

MAX_RUN = 256           # longest run the lowering takes (longer: the planned walk's chunked kernel)
SUB_RUN = 16            # the pieces a run is cut into (one map more in the chain per piece)
PAD_RUN = 16            # the pad tokens' runs (their length only has to stay within the longest real run's chunk)
# the pad tokens through the MoE's routed experts like tokens (before the thirty-ninth session; gpu_bench's variant
# `pads_routed`). False: the batch names its real rows (ForwardBatch.real_rows) and the experts leave the pads out.
# Pads are one token id at one position and route alike: the 35B request's 32 pads piled onto one top-k set of
# experts (moe_bench: 45 rows on one), whose gate/up tiles then streamed from DRAM once per BM = 16 rows (H100 run 125:
# `pads_routed` +1.33 ms on the warm request, paired)
PADS_ROUTED = False
MAX_TOKENS = 2048       # most active tokens
_NEVER = 1 << 62        # the mask position of a key no query may see
# lowered layouts kept for requests of the same layout (`layout_key`: segment lengths, positions, cut): such a request
# takes the tables but its token ids from the kept one instead of lowering again (~0.5-0.7 ms of host time before the
# GPU starts on the 35B request), and where its buffers last loaded that layout only the ids are copied in
LAYOUTS = 16
# the fill's packing in one launch per graph piece (ops/triton_copy.py) where Triton runs; False: torch.cat per layer.
# Off: with the fill staged per piece, only the first piece's fill delays the GPU, and torch.cat was 0.2-0.3 ms
# faster end to end in both interleaved runs (H200 runs 34, 35); kept as gpu_bench's variant `fill_by_address`
COPY_BY_ADDRESS = False
# with the graph in pieces on CUDA, the fills after the first on a stream of their own: a piece's fill (the cached keys'
# and values' copies, with layers/attention.py ORDER_AHEAD their ordering too; the conv tails; the step tables) runs
# beside the pieces before it instead of between them, and only its own piece waits for it. Off: no gain measured
# (H100 run 103, paired by round: every fill on the pass's stream -0.02 ms against it; with the keys ordered ahead,
# +0.43 ms in run 102, but ordering ahead itself cost more); gpu_bench's variant `fills_beside`
SIDE_FILL = False
# a request's query (its last run, n <= QUERY_TAIL tokens) outside the chain, where every stateful layer can take it
# (`query_tail`): its pieces of SUB_RUN tokens summarized with the other runs, the chain ending where it starts, and the
# pieces walked from the chain's last state by one launch per layer (layers/linear.py `_tail`, op gated_delta_tail: their
# outputs and the request's final state); 0: its pieces chained like the others. The first form (H200 run 107: +1.26 ms)
# summarized the query as one 64-token chunk by a call of its own (32 programs, 1 KB of spills). This form: H100 run 109,
# -0.73 ms paired against the chained query (gpu_bench's variant `query_chained`; CUDA test
# test_cuda_graph_compose_with_query_tail, passed in run 108)
QUERY_TAIL = 64


@dataclass(frozen=True)
class ComposeShape:
    tokens: int         # Np
    runs: int           # R, the pad runs included (with a tail: the chained runs, then the tail's; no pad runs)
    entries: int        # E
    keys: int           # Kc bucket: cached keys per attention layer
    held: int           # P bucket: keys the request holds before the pass (a cached prefix)
    lmax: int           # longest chained run, padded (the readout correction's row count)
    tail: int = 0       # the query's runs outside the chain (`lower`'s tail_max): how many (the last runs), else 0


def _round(n: int, step: int) -> int:
    return -(-n // step) * step


def _keys_bucket(n: int, least: int = 256) -> int:
    if n <= least:
        return least
    step = max(least, 1 << (n.bit_length() - 4))
    return _round(n, step)


@dataclass
class Lowered:
    """One request's layout: the shape, the host tables and the cached tensors to stack."""

    shape: ComposeShape
    n: int                      # active tokens
    kc: int                     # cached keys
    held: int                   # keys held before the pass
    state: object               # the request's SeqState (initial linear states and held keys)
    tables: dict                # name -> CPU tensor (copied into the fixed buffer of that name)
    entries: list               # the Apply pieces' entries, storage order
    tail_rows: list             # rows each entry's tail occupies in the conv source (per linear layer: same)
    kmask: torch.Tensor         # the mask position of every key (host only: kperm and qlast are made from it)
    pairs: tuple                # `pair_runs` of the chain: (steps kept, the entry after each run or -1)
    memo: dict = field(default_factory=dict)   # what the layers of one kind derive alike from the tables
    key: tuple | None = None    # the layout's `layout_key` where it was kept for reuse (`GraphCompose.layouts`)

    def kept(self, key: tuple) -> "Lowered":
        """This layout without the request's own parts (its state, entries, token ids), to be reused."""
        tables = dict(self.tables)
        tables["ids"] = None
        return replace(self, state=None, entries=[], tables=tables, key=key)

    def again(self, work: SeqWork, ids: list[int]) -> "Lowered":
        """A kept layout (`kept`) as the tables of another request of the same layout: its state, entries and
        token ids; every other table and the memo shared (read only)."""
        tok_ids = np.zeros(self.shape.tokens, dtype=np.int64)
        tok_ids[: self.n] = ids[work.start : work.end]
        tables = dict(self.tables)
        tables["ids"] = torch.from_numpy(tok_ids)
        return replace(self, state=work.state, entries=[p.entry for p in work.pieces if isinstance(p, Apply)],
                       tables=tables)


def layout_key(work: SeqWork, positions: list[int], conv_width: int, held: int, tail_max: int) -> tuple | None:
    """Everything `lower` reads of a request but its token ids and state, as a hashable key: two requests with
    equal keys lower to the same tables but `ids` (the same segment lengths in any order, say, at fixed-size
    chunking). None where the lowering reads more (keys held before the pass: their positions) or would decline
    (a run that summarizes or marks)."""
    if held:
        return None
    wm1 = max(conv_width - 1, 0)
    key = [work.start, work.end, conv_width, tail_max]
    for p in work.pieces:
        if isinstance(p, Run):
            if p.summarize or p.mark:
                return None
            key.append((p.start, p.end))
        else:
            key.append((p.position, p.entry.cached_tokens, _tail_len(p.entry, wm1)))
    key.append(tuple(positions[work.start : work.end]))
    return tuple(key)


def lower(work: SeqWork, ids: list[int], positions: list[int], conv_width: int, held: int,
          tail_max: int = 0) -> Lowered | None:
    """The request's tables, or None when the lowering does not cover it. held: keys the request's
    attention layers hold already (with their positions in the state). tail_max > 0: a last run (the query) of
    n <= tail_max tokens becomes the tail: its pieces (of SUB_RUN tokens, summarized with the other runs) last in
    storage and outside the chain (the chain ends at its start; the linear layers walk them from there:
    layers/linear.py `_tail`), and the pad tokens are rows of no run (the rows after the tail's: their outputs
    zero)."""
    runs = [p for p in work.pieces if isinstance(p, Run)]
    applies = [p for p in work.pieces if isinstance(p, Apply)]
    if not applies or not runs or any(r.summarize or r.mark or r.n > MAX_RUN for r in runs):
        return None
    if conv_width > 1 and not isinstance(work.pieces[-1], Run):
        # the conv window the request keeps is its last token's newest inputs (the conv kernel writes it from those:
        # layers/linear.py): a request that ends in a cached segment (not a prompt: a query is always active) goes
        # the planned way
        return None
    n = work.end - work.start
    if work.start != 0 or n + 1 > MAX_TOKENS:
        return None
    np_ = _round(n + 1, 64)
    pad = np_ - n
    last = work.pieces[-1]
    tail = last if isinstance(last, Run) and last.n <= tail_max else None
    if tail is not None and not any(isinstance(p, Run) for p in work.pieces[:-1]):
        tail = None                                  # (no chained run before it: chained as the others)
    pieces = _cut(work.pieces, SUB_RUN)
    runs = [p for p in pieces if isinstance(p, Run)]
    nt = -(-tail.n // SUB_RUN) if tail else 0        # the tail's runs: the last nt (the query's pieces)
    step = min(SUB_RUN, PAD_RUN)
    pads = [] if tail else [min(step, pad - a) for a in range(0, pad, step)]
    e, r = len(applies), len(runs) + len(pads)
    lens = [p.n for p in runs] + pads
    lmax = _round(max(lens), 8)
    kc = sum(p.entry.cached_tokens for p in applies)
    # the chain in sequence order (storage: entries 0..E-1, runs E..E+R-1), the pad runs last; the tail's runs (last
    # in storage) in no chain
    order, ei, ri = [], 0, 0
    for p in pieces:
        if isinstance(p, Apply):
            order.append(ei)
            ei += 1
        else:
            if ri < len(runs) - nt:
                order.append(e + ri)
            ri += 1
    main = len(order)                                # the request's chain; the pad runs: a second one
    order.extend(range(e + ri, e + r))               # (with a tail: no pad runs; the tail's slots last, unchained)
    order.extend(range(e + ri - nt, e + ri))
    shape = ComposeShape(np_, r, e, _keys_bucket(kc), _keys_bucket(held) if held else 0, lmax, nt)

    # host tables in numpy (single-threaded: small torch CPU ops cost a thread-pool wake-up each), handed
    # over as tensors without a copy
    lens_a = np.asarray(lens, dtype=np.int64)
    cu = np.zeros(r + 1, dtype=np.int64)
    np.cumsum(lens_a, out=cu[1:])
    # rows past the runs' (the pads', with a tail): the last run's index, row 0, for the correction's gather (the
    # tail's slots are no chained run's: the tail writes them); without a tail the pad runs cover every row
    run_of = np.full(np_, r - 1, dtype=np.int64)
    run_of[: cu[r]] = np.repeat(np.arange(r, dtype=np.int64), lens_a)
    pos_in_run = np.arange(np_, dtype=np.int64) - cu[:-1][run_of]
    pos_in_run[cu[r] :] = 0
    # conv: the stream of raw inputs as the recurrence sees them (entries by their tails)
    wm1 = max(conv_width - 1, 0)
    tail_rows, row = [], wm1
    for p in applies:
        t = _tail_len(p.entry, wm1)
        tail_rows.append((row, t))
        row += t
    active0 = wm1 * (1 + e)
    stream, at, ei = list(range(wm1)), [], 0          # at: each active token's place in the stream
    for p in work.pieces:
        if isinstance(p, Apply):
            a, t = tail_rows[ei]
            stream.extend(range(a, a + t))
            ei += 1
            continue
        at.extend(range(len(stream), len(stream) + p.n))
        stream.extend(range(active0 + p.start, active0 + p.end))
    stream_a = np.asarray(stream, dtype=np.int64)
    conv_idx = np.empty((np_, max(conv_width, 1)), dtype=np.int64)
    if conv_width:
        conv_idx[:n] = stream_a[np.asarray(at, dtype=np.int64)[:, None] + np.arange(-wm1, 1)[None, :]]
        conv_idx[n:] = np.arange(active0 + n, active0 + np_)[:, None]   # pads: their own row (finite, unused)
    window = stream_a[len(stream) - wm1:]
    # attention: the cached keys' positions, then the mask position of every key (pads never visible); ranges
    # made as one arange plus a repeated offset per block (~40 blocks of ~1,600 keys on the 35B request)
    p0 = shape.held
    clen = np.fromiter((p.entry.cached_tokens for p in applies), dtype=np.int64, count=e)
    cstart = np.zeros(e, dtype=np.int64)
    np.cumsum(clen[:-1], out=cstart[1:])
    kpos = np.zeros(shape.keys, dtype=np.int64)
    if kc:
        cpos = np.fromiter((p.position for p in applies), dtype=np.int64, count=e)
        kpos[:kc] = _ranges(cpos, clen)
    kmask = np.full(shape.held + shape.keys + np_, _NEVER, dtype=np.int64)
    if held:
        kmask[:held] = _held_positions(work.state).numpy()
    kmask[p0 : p0 + kc] = kpos[:kc]
    tok_pos = np.zeros(np_, dtype=np.int64)
    tok_pos[:n] = positions[work.start:work.end]
    kmask[p0 + shape.keys : p0 + shape.keys + n] = tok_pos[:n]
    # the keys in position order (those never visible last): the held keys, then each piece's keys in
    # sequence order (a cached segment's block, a run's tokens); a stable sort where that is not ordered
    starts, lengths, ei, active = [0], [held], 0, 0
    for p in work.pieces:
        if isinstance(p, Apply):
            starts.append(p0 + int(cstart[ei]))
            lengths.append(int(clen[ei]))
            ei += 1
        else:
            starts.append(p0 + shape.keys + p.start - work.start)
            lengths.append(p.n)
            active += p.n
    seen = _ranges(np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64))
    if active == n:            # the runs cover the active tokens: the rest are the unused slots (of the held keys'
        kperm = np.concatenate([seen, np.arange(held, p0, dtype=np.int64),            # and the cached keys' buckets)
                                np.arange(p0 + kc, p0 + shape.keys, dtype=np.int64),  # and the pads, ascending
                                np.arange(p0 + shape.keys + n, kmask.shape[0], dtype=np.int64)])
    else:
        rest = np.ones(kmask.shape[0], dtype=bool)
        rest[seen] = False
        kperm = np.concatenate([seen, np.flatnonzero(rest)])
    sorted_mask = kmask[kperm]
    if sorted_mask.shape[0] > 1 and not (sorted_mask[1:] >= sorted_mask[:-1]).all():
        kperm = np.argsort(kmask, kind="stable")
        sorted_mask = kmask[kperm]
    qlast = np.searchsorted(sorted_mask, tok_pos, side="right") - 1        # pads (position 0): key 0
    tok_ids = np.zeros(np_, dtype=np.int64)
    tok_ids[:n] = ids[work.start:work.end]
    t = torch.from_numpy
    pairs = pair_runs(np.asarray(order, dtype=np.int64), main, e)
    paired = int((~pairs[0]).sum())
    chained = len(pads)                               # the second chain: the pad runs (none with a tail)
    tables = dict(ids=t(tok_ids), positions=t(tok_pos), logits_index=torch.tensor([n - 1]), real=torch.tensor([n]),
                  cu=t(cu), cu_maps=torch.tensor([0, main, main + chained], dtype=torch.int32),
                  cu_pairs=torch.tensor([0, main - paired, main + chained - paired], dtype=torch.int32),
                  order=torch.tensor(order, dtype=torch.int32),
                  run_of=t(run_of), pos_in_run=t(pos_in_run), kpos=t(kpos), kperm=t(kperm), qlast=t(qlast))
    if conv_width:
        tables.update(conv_idx=t(conv_idx), window=t(window))
    return Lowered(shape, n, kc, held, work.state, tables, [p.entry for p in applies], tail_rows, t(kmask), pairs)



def pair_runs(order: np.ndarray, main: int, e: int) -> tuple[np.ndarray, np.ndarray]:
    """The chain's runs paired with the cached map right after them (a seam window and the rest of its segment):
    (keep [len(order)] bool: False at each paired cached map's step, which the pair's map takes over; the entry
    that follows each run, [R] int64, -1 where none does). Steps 0..main-1 are the request's chain (the pad
    chain after it is left alone)."""
    keep = np.ones(order.shape[0], dtype=bool)
    after = np.full(order.shape[0] - e, -1, dtype=np.int64)
    j = np.arange(max(main - 1, 0))
    hit = j[(order[j] >= e) & (order[j + 1] < e)]
    keep[hit + 1] = False
    after[order[hit] - e] = order[hit + 1]
    return keep, after


def pack_blocks(blocks: list, dst: torch.Tensor, row0: int = 0, last: list | None = None) -> list | None:
    """The copies that pack the blocks (cache/entry.py `block` tuples) one after another into dst's rows from
    row0, as (source address, destination address, bytes); last[i] (optional) keeps only block i's last
    rows. None where one cannot be copied by address (another layout, dtype or device; not 16-byte aligned).
    Plain integer arithmetic on the entries' cached addresses: ~1,000 blocks per request on the 35B model
    (making a tensor view per block cost ~8 ms of host time there, H200 run 32)."""
    size = dst.element_size() * (dst.numel() // dst.shape[0])
    base, dt, dev = dst.data_ptr(), dst.dtype, dst.device
    out, row = [], row0
    for i, b in enumerate(blocks):
        if b is None or b[2] != size or b[3] is not dt or b[4] != dev:
            return None
        n = b[1] if last is None else last[i]
        src = b[0] + (b[1] - n) * size
        blk = (src, base + row * size, n * size)
        if blk[0] % 16 or blk[1] % 16 or blk[2] % 16:
            return None
        out.append(blk)
        row += n
    return out


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The ranges [starts[i], starts[i] + lengths[i]) one after another, as one int64 array."""
    total = int(lengths.sum())
    offs = np.zeros(lengths.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], out=offs[1:])
    return np.arange(total, dtype=np.int64) + np.repeat(starts - offs, lengths)


def _cut(pieces: list, k: int) -> list:
    """The pieces with every run longer than k cut into consecutive runs of at most k tokens."""
    out = []
    for p in pieces:
        if isinstance(p, Run) and p.n > k:
            out.extend(Run(a, min(a + k, p.end)) for a in range(p.start, p.end, k))
        else:
            out.append(p)
    return out


def _held_positions(state) -> torch.Tensor:
    for part in state.layers.values():
        if isinstance(part, KVBuffer):
            return part.view()[2].cpu()
    raise ValueError("no attention state")


def held_keys(model, state) -> int | None:
    """Keys every attention layer of the state holds (None: the layers disagree, or a state type the
    lowering does not take)."""
    counts = set()
    for l, m in model.mixers.items():
        part = state.layers.get(l)
        if part is None:
            counts.add(0)
        elif isinstance(part, KVBuffer):
            counts.add(part.n)
        elif not isinstance(part, LinearState):
            return None
    return counts.pop() if len(counts) == 1 else (0 if not counts else None)


def _tail_len(entry, wm1: int) -> int:
    return min(entry.tail_len, wm1)


class ComposeBuffers:
    """The fixed buffers of one shape: tables, per-layer slots, and what the pass reads them through."""

    def __init__(self, model, shape: ComposeShape, device, dtype):
        self.shape = shape
        self.mixers = model.mixers
        self.device = device = torch.device(device)
        np_, r, e = shape.tokens, shape.runs, shape.entries
        z = lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        self.ids, self.positions, self.logits_index, self.real = z(np_), z(np_), z(1), z(1)
        self.cu, self.run_of, self.pos_in_run = z(r + 1), z(np_), z(np_)
        self.cu_maps, self.cu_pairs, self.order = z(3, dt=torch.int32), z(3, dt=torch.int32), z(e + r, dt=torch.int32)
        nkeys = shape.held + shape.keys + np_
        self.kpos, self.kperm, self.qlast = z(shape.keys), z(nkeys), z(np_)
        self.aslot = z(np_)             # (made on the device where a layer orders its keys ahead: `active_slots`)
        self.kidx = torch.arange(nkeys, device=device)          # the sorted keys' positions: their indices
        self.conv_idx, self.window = None, None
        self.layers = {}
        shared: dict = {}                # read-only tensors the layers of one shape share
        for l, m in self.mixers.items():
            self.layers[l] = m.compose_buffers(shape, device, dtype, shared)
            w = getattr(m, "conv_width", 0)
            if w and self.conv_idx is None:
                self.conv_idx, self.window = z(np_, w), z(w - 1)
        self.outputs: dict = {}         # layer -> what the pass leaves for the states (set by each forward)
        # the request's tables as views of one device buffer per dtype, each copied from one host buffer (pinned on
        # CUDA: one asynchronous copy instead of ~13 staged ones from pageable memory)
        cuda = device.type == "cuda"
        self._groups, self._slots = [], {}       # (device, host, host as numpy) per dtype; table -> (group, a, b)
        for dt, names in ((torch.long, ["ids", "positions", "logits_index", "real", "cu", "run_of", "pos_in_run",
                                        "kpos", "kperm", "qlast"]
                          + (["conv_idx", "window"] if self.conv_idx is not None else [])),
                          (torch.int32, ["cu_maps", "cu_pairs", "order"])):
            sizes = [getattr(self, nm).numel() for nm in names]
            dev = torch.zeros(sum(sizes), dtype=dt, device=device)
            host = torch.zeros(sum(sizes), dtype=dt, pin_memory=cuda)
            a = 0
            for nm, k in zip(names, sizes):
                setattr(self, nm, dev[a : a + k].view(getattr(self, nm).shape))
                self._slots[nm] = (len(self._groups), a, a + k)
                a += k
            self._groups.append((dev, host, host.numpy()))
        self._copied = None              # an event after the last copy from the pinned host buffers (CUDA)
        self._layout = None              # the layout key whose tables the device buffers hold (None: not a kept one)
        # the chain step tables of the layers whose scan reads maps in place: one host and one device tensor,
        # a row per layer, filled by each layer's compose_fill and copied piece by piece; each layer's E + R steps,
        # then R rows for its runs' pairs (the low-rank pairs' table, where a layer pairs: layers/linear.py)
        self.steps = None
        users = shared.get("steps", [])
        if users:
            host = torch.zeros(len(users), e + 2 * r, 6, dtype=torch.long, pin_memory=cuda)
            dev = torch.zeros(len(users), e + 2 * r, 6, dtype=torch.long, device=device)
            for i, buf in enumerate(users):
                buf["steps_host"], buf["steps"] = host[i, : e + r], dev[i, : e + r]
                buf["pairs_host"], buf["pairs"] = host[i, e + r :], dev[i, e + r :]
            self.steps = (host, dev)
            self.steps_layers = [l for l in self.layers if any(self.layers[l] is b for b in users)]
        self.copy_tables: list = []
        self.scratch: dict = {}          # what the fills of one request derive alike (RoPE tables of the cached keys)

    def batch(self) -> ForwardBatch:
        return ForwardBatch(self.ids, self.positions, [], self.logits_index, captured=self,
                            real_rows=None if PADS_ROUTED else self.real)

    def active_slots(self) -> torch.Tensor:
        """aslot [Np]: the place in position order of each active (and pad) token's key, the inverse of kperm on
        those rows, made once per request (after load_tables) by one scatter on the device (layers/attention.py
        ORDER_AHEAD: the pass writes its keys there)."""
        if not self.scratch.get("aslot"):
            inv = torch.empty_like(self.kperm)
            inv.scatter_(0, self.kperm, self.kidx)
            self.aslot.copy_(inv[self.shape.held + self.shape.keys :])
            self.scratch["aslot"] = True
        return self.aslot

    def load(self, low: Lowered) -> None:
        """The request's tables and every layer's cached tensors into the buffers."""
        self.load_tables(low)
        self.fill(low, 0, 1 << 30)

    def load_tables(self, low: Lowered) -> None:
        with span("compose.load_tables"):
            if self._copied is not None:     # the host buffers are rewritten only once the last request's copies ran
                self._copied.synchronize()   # (long done: its first token was read back since)
            # a kept layout these buffers loaded last (the same key object): its tables are in place but the ids
            same = low.key is not None and low.key is self._layout
            for name, t in low.tables.items():
                if same and name != "ids":
                    continue
                g, a, b = self._slots[name]
                if t.numel() != b - a:
                    raise ValueError(f"table {name}: {t.numel()} values for a buffer of {b - a}")
                self._groups[g][2][a:b] = t.numpy().reshape(-1)
                if same:
                    dev, host, _ = self._groups[g]
                    dev[a:b].copy_(host[a:b], non_blocking=True)
            if not same:
                for dev, host, _ in self._groups:
                    dev.copy_(host, non_blocking=True)
            self._layout = low.key
            self._mark_copied()
            self.copy_tables = []
            self.scratch.clear()

    def _mark_copied(self) -> None:
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def fill(self, low: Lowered, lo: int, hi: int) -> None:
        """The cached tensors of the layers lo..hi-1 into their buffers (after load_tables)."""
        from ..ops.fast import kernel_failed, triton_here, triton_kernel

        copy = triton_kernel("copy") if COPY_BY_ADDRESS and triton_here(self.ids) else None
        copies = [] if copy is not None else None
        mixers = [(l, m) for l, m in self.mixers.items() if lo <= l < hi]
        for l, m in mixers:
            m.compose_fill(self.layers[l], low, l, copies)
        if copies:
            # the cached segments' keys, values and conv tails of these layers in one launch (as torch.cat
            # calls: ~50 launches of ~90 us of host time each on the 35B request)
            try:
                self.copy_tables.append(copy(np.asarray(copies, dtype=np.int64), self.device))
            except Exception as e:  # the kernel cannot be built here: the same packing by torch.cat
                kernel_failed("copy", e)
                for l, m in mixers:
                    m.compose_fill(self.layers[l], low, l)
        for l, m in mixers:          # what a layer makes of its cached tensors alone (before the pass reaches it)
            ahead = getattr(m, "compose_ahead", None)
            if ahead is not None:
                ahead(self.layers[l], low, self)
        if self.steps is not None:
            rows = [i for i, l in enumerate(self.steps_layers) if lo <= l < hi]
            if rows:
                a, b = rows[0], rows[-1] + 1                       # layers in order: a contiguous slice
                self.steps[1][a:b].copy_(self.steps[0][a:b], non_blocking=True)
                self._mark_copied()


class GraphCompose:
    """Engine-side owner: `forward(work, ids, positions)` -> last-token logits [1, V], or None when the
    lowering does not cover the request. graphs: replay a CUDA graph per shape (CUDA only); else the
    same buffers run eagerly."""

    def __init__(self, model, device, dtype, *, graphs: bool, max_shapes: int = 2, capture_after: int = 2,
                 pieces: int = 1, first_piece: int = 0):
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.pieces = pieces                         # graphs per shape (graphs.capture_forward)
        self.first_piece = first_piece               # layers in the first of them (0: equal pieces)
        self.graphs = graphs and self.device.type == "cuda"
        self.max_shapes = max_shapes
        # with graphs, a shape gets buffers and a graph on its capture_after-th request (a capture costs
        # three forwards; a one-off shape goes the planned way); the counts of recent shapes are kept
        self.capture_after = capture_after
        self.seen: OrderedDict = OrderedDict()
        self.ready: OrderedDict = OrderedDict()      # shape -> (buffers, graph | None, logits | None, pinned)
        mixers = model.mixers.values()
        self.supported = bool(mixers) and all(getattr(m, "graph_compose", False) for m in mixers)
        # a mixer whose kernel reads lengths on the host (the reference ops) runs the buffers eagerly
        self.graphs = self.graphs and self.supported and all(m.capturable(self.device) for m in mixers)
        self.conv_width = max((getattr(m, "conv_width", 0) for m in mixers), default=0)
        self.tail_ok = all(m.query_tail(CHUNK_MAX) for m in mixers if hasattr(m, "query_tail"))
        self.captures = 0
        self.replays = 0
        self.runs = 0                                # requests composed over the fixed buffers
        self.capture_error: str | None = None
        self.pending = None                          # (work, outputs, buffers, lowered) whose states are not made yet
        self._side = None                            # the later pieces' fill stream (SIDE_FILL; made on first use)
        self.layouts: OrderedDict = OrderedDict()    # layout_key -> Lowered.kept (LAYOUTS most recent)
        self.layout_hits = 0

    def clear(self) -> None:
        """Drop every shape's buffers and graph (they hold copies of cached entries' tensors)."""
        self.settle()
        self.ready.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def nbytes(self) -> int:
        """Bytes of the fixed buffers held (graph pools not counted)."""
        total = 0
        for bufs, *_ in self.ready.values():
            seen = set()
            for d in bufs.layers.values():
                for t in d.values():
                    if torch.is_tensor(t) and id(t) not in seen:
                        seen.add(id(t))
                        total += t.element_size() * t.nelement()
        return total

    def _slot(self, shape: ComposeShape):
        hit = self.ready.get(shape)
        if hit is not None:
            self.ready.move_to_end(shape)
            return hit
        while len(self.ready) >= self.max_shapes:
            self.ready.popitem(last=False)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        bufs = ComposeBuffers(self.model, shape, self.device, self.dtype)
        hit = [bufs, None, None, []]
        self.ready[shape] = hit
        return hit

    def _capture(self, hit) -> None:
        bufs = hit[0]
        batch = bufs.batch()
        try:
            graph, logits, pinned = capture_forward(self.model, batch, self.device, self.pieces, self.first_piece)
            hit[1], hit[2], hit[3] = graph, logits, [pinned, dict(bufs.outputs), batch.scratch]
            self.captures += 1
        except Exception as e:  # an op that cannot be captured: the same buffers, eagerly
            log.warning("compose graph capture failed (%s: %s); composing eagerly", type(e).__name__, e,
                        exc_info=True)
            self.capture_error = f"{type(e).__name__}: {e}"
            self.graphs = False

    def settle(self, keep: bool = True) -> None:
        """The pending request's states cut out of the pass's outputs (keep), or dropped (a request that ended
        at its first token needs none). A no-op when nothing is pending."""
        pending, self.pending = self.pending, None
        if pending is None or not keep:
            return
        work, outputs, bufs, low = pending
        with span("compose.state"), torch.inference_mode():
            for l, m in self.model.mixers.items():
                work.state.layers[l] = m.compose_state(outputs[l], bufs, low, work.state.layers.get(l),
                                                       work.state.capacity_hint)

    def _filler(self, bufs, low, staged: bool):
        """What a replay runs on the host before each piece (None: the buffers were filled whole). With SIDE_FILL on
        CUDA, the first piece's fill goes on the pass's stream and every later one on a side stream that waited for
        everything queued up to the end of that first fill (the tables' copies, the last request's reads of these
        buffers, what the first fill made for the others: RoPE tables), not for the first piece; the pass's stream
        waits for a fill just before that fill's piece, so the fill runs beside the pieces before it."""
        if not staged:
            return None
        side = main = None
        if SIDE_FILL and self.device.type == "cuda":
            main = torch.cuda.current_stream(self.device)
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            side = self._side

        def fill(lo, hi):
            with span("compose.fill"):
                if side is None or lo == 0:          # (replay: the first piece's fill comes first)
                    bufs.fill(low, lo, hi)
                    if side is not None:
                        side.wait_stream(main)
                    return
                with torch.cuda.stream(side):
                    bufs.fill(low, lo, hi)
                for l in range(lo, hi):       # tensors a fill made there (maps copied to fp32) are read on main
                    for t in bufs.layers.get(l, {}).get("keep", ()):
                        t.record_stream(main)
                main.wait_stream(side)

        return fill

    def _lower(self, work: SeqWork, ids: list[int], positions: list[int], held: int) -> Lowered | None:
        """`lower`, or a kept layout of the same key (`layout_key`) with this request's state, entries and ids."""
        tail = QUERY_TAIL if self.tail_ok else 0
        key = layout_key(work, positions, self.conv_width, held, tail) if LAYOUTS else None
        hit = self.layouts.get(key) if key is not None else None
        if hit is not None:
            self.layouts.move_to_end(key)
            self.layout_hits += 1
            return hit.again(work, ids)
        low = lower(work, ids, positions, self.conv_width, held, tail)
        if low is not None and key is not None:
            kept = low.kept(key)
            low.key = key
            self.layouts[key] = kept
            while len(self.layouts) > LAYOUTS:
                self.layouts.popitem(last=False)
        return low

    @torch.inference_mode()
    def forward(self, work: SeqWork, ids: list[int], positions: list[int], exact: bool,
                defer: bool = False) -> torch.Tensor | None:
        """defer: leave the request's states pending (`settle` makes them), so the first token can be sampled
        before the state copies are queued; else they are made here."""
        self.settle()                          # an earlier request's, before its buffers are reused
        if not (self.supported and exact):
            return None
        with span("compose.lower"):
            held = held_keys(self.model, work.state)
            low = None if held is None else self._lower(work, ids, positions, held)
        if low is None:
            return None
        if self.graphs and low.shape not in self.ready:
            n = self.seen.pop(low.shape, 0) + 1
            self.seen[low.shape] = n
            while len(self.seen) > 256:
                self.seen.popitem(last=False)
            if n < self.capture_after:
                return None
        hit = self._slot(low.shape)
        bufs = hit[0]
        staged = hit[1] is not None and len(hit[1].graphs) > 1
        with span("compose.load"):
            if staged:                      # each piece's layers filled just before its graph is launched
                bufs.load_tables(low)
            else:
                bufs.load(low)
        if self.graphs and hit[1] is None:
            self._capture(hit)
        if hit[1] is not None:
            fill = self._filler(bufs, low, staged)
            with span("compose.replay"):
                hit[1].replay(fill)
            logits, outputs = hit[2], hit[3][1]
            self.replays += 1
        else:
            logits = self.model(bufs.batch())
            outputs = bufs.outputs
        self.pending = (work, outputs, bufs, low)
        logits = logits.clone()
        if not defer:
            self.settle()
        self.runs += 1
        return logits
