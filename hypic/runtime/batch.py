"""The flat bundle of tensors one forward pass reads, planned on the CPU.

A batch holds the *active* tokens of several sequences back to back (`input_ids`, `positions`,
one flat axis N). Each sequence is a `SeqWork`: its running `SeqState` and an ordered list of
pieces that every layer walks:

    Run(start, end)      active tokens [start, end) of the flat axis, processed with the
                         running state (linear layers) and appended to the KV (attention)
    Apply(entry, pos)    a cached segment summary composed into the running state:
                         linear layers  state <- T @ state + S  (naive: state + S), conv <- tail
                         attention      the entry's K/V placed at positions pos, pos+1, ...

Positions are computed in exactly one place: `BatchBuilder`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .state import SeqState


@dataclass
class Run:
    start: int
    end: int
    summarize: bool = False   # capture this run's zero-start summary (T, S, conv tail, raw K/V)
    mark: bool = False        # capture the state after this run (a prefix-cache boundary)
    part: bool = False        # with mark: one part of a boundary span cut by chunked prefill (joins the next part)
    captures: dict[int, Any] = field(default_factory=dict)   # layer -> the mixer's captured part

    @property
    def n(self) -> int:
        return self.end - self.start


@dataclass
class Apply:
    entry: Any                # cache.entry.SegmentEntry
    position: int             # absolute position of the entry's first cached token


@dataclass
class SeqWork:
    state: SeqState
    pieces: list
    start: int                # flat range of this sequence's active tokens
    end: int

    @property
    def runs(self) -> list[Run]:
        return [p for p in self.pieces if isinstance(p, Run)]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor   # [N] int64
    positions: torch.Tensor   # [N] int64, absolute
    seqs: list[SeqWork]
    logits_index: torch.Tensor  # [M] flat rows whose logits are returned
    exact_transition: bool = True
    walk: str = "phased"        # linear layers: "phased" (batched compose) or "rounds" (the plain walk)
    scratch: dict[str, Any] = field(default_factory=dict)   # per-forward derived tensors (RoPE tables)
    static: Any = None          # runtime.decode.StaticDecode: one token per row over fixed buffers (no seqs)
    captured: Any = None        # runtime.compose_graph.ComposeBuffers: one lowered request over fixed buffers
    # the rows the rest of the forward still reads (the logits rows), set by the model for its last layer
    # (CausalLM.run_layers): a mixer may then compute its output for these rows only (others zero), and a layer
    # drops the other rows (`kept`) once its stateful mixers have run, so its MLP runs on these rows alone
    keep: torch.Tensor | None = None
    # [1] int64 on the device: the rows from it on are padding (the compose graph's pad tokens, which only keep the
    # fixed buffers' shapes); None: every row is a token. A MoE leaves padding rows out of its experts (`padding_from`)
    real_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def padding_from(self, h: torch.Tensor) -> torch.Tensor | None:
        """`real_rows` where h holds every row of the batch (not the last layer's kept rows), else None."""
        if self.real_rows is None or h.shape[0] != self.input_ids.shape[0]:
            return None
        return self.real_rows

    def kept(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, ...] cut to the rows `keep` names (in its order); h itself where nothing is cut (or already was)."""
        if self.keep is None or h.shape[0] != self.input_ids.shape[0]:
            return h
        return h.index_select(0, self.keep)

    def keep_rows(self) -> list[int] | None:
        """`keep` on the host (read once per forward), for the planned paths that split rows per sequence."""
        if self.keep is None:
            return None
        rows = self.scratch.get("keep_rows")
        if rows is None:
            rows = self.scratch["keep_rows"] = self.keep.tolist()
        return rows


class BatchBuilder:
    """Collects sequences, then emits one ForwardBatch. Pieces are given as token lists (runs) or
    entries; flat offsets and absolute positions are assigned here, from each state's length."""

    def __init__(self, device):
        self.device = device
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.seqs: list[SeqWork] = []
        self.logits_rows: list[int] = []

    def add(self, state: SeqState, items: Sequence, *, logits: str = "last") -> SeqWork:
        """items: ("run", token_ids, flags) | ("apply", entry, n_positions). Advances state.length.

        logits: "last" (the last active token), "all" (every active token) or "none".
        """
        start = len(self.ids)
        pieces = []
        p = state.length
        for item in items:
            kind = item[0]
            if kind == "run":
                toks, flags = item[1], item[2] if len(item) > 2 else {}
                if not toks:
                    continue
                s = len(self.ids)
                self.ids.extend(toks)
                self.pos.extend(range(p, p + len(toks)))
                p += len(toks)
                last = pieces[-1] if pieces else None
                if isinstance(last, Run) and not (last.summarize or last.mark) and not flags.get("summarize"):
                    last.end, last.mark = len(self.ids), bool(flags.get("mark"))   # one run: same recurrence
                    last.part = bool(flags.get("part"))
                else:
                    pieces.append(Run(s, len(self.ids), **flags))
            elif kind == "apply":
                entry = item[1]
                pieces.append(Apply(entry, p))
                p += entry.cached_tokens
            else:
                raise ValueError(kind)
        state.length = p
        work = SeqWork(state, pieces, start, len(self.ids))
        if logits == "last" and work.end > work.start:
            self.logits_rows.append(work.end - 1)
        elif logits == "all":
            self.logits_rows.extend(range(work.start, work.end))
        self.seqs.append(work)
        return work

    def build(self, *, exact_transition: bool = True, walk: str = "phased") -> ForwardBatch:
        # pageable host -> device without non_blocking makes PyTorch synchronize the stream: the host
        # would stop running ahead of the GPU at every forward
        t = lambda x: torch.tensor(x, dtype=torch.long).to(self.device, non_blocking=True)  # noqa: E731
        return ForwardBatch(t(self.ids), t(self.pos), self.seqs, t(self.logits_rows), exact_transition, walk)
