"""The engine loop: plan -> cold prefill -> compose -> decode -> emit.

    prefill(requests)   stages 1-4 for a batch of requests, returns last-token logits
    step(requests)      one batched decode step
    generate(...)       prefill + decode until every request stops
The caches (segment store, prefix cache) live here; only this module mutates them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..cache.entry import KVSpan, PrefixNode
from ..cache.prefix import PrefixCache
from ..cache.store import Doorkeeper
from ..cache.tiers import TieredStore
from ..config import CacheMode, CachePolicy, EngineConfig
from ..plan.planner import Planner, PrefillPlan
from ..prefill.isolated import prefill_segments
from ..prefill.parallel import SegmentWorkers
from ..prefill.placement import chunks, segment_cost
from ..segment.spans import TokenizedPrompt
from ..types import RequestOutput, SamplingParams
from .batch import BatchBuilder
from .compose_graph import GraphCompose
from .decode import StaticDecoder
from .sampler import sample
from .trace import span
from .state import SeqState


@dataclass
class Request:
    prompt: TokenizedPrompt
    params: SamplingParams
    policy: CachePolicy
    state: SeqState | None = None
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    t_start: float = 0.0
    ttft_s: float = 0.0
    finish_reason: str | None = None
    counts: dict = field(default_factory=dict)
    logits: list = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(self, loaded, config: EngineConfig):
        self.loaded = loaded
        self.model = loaded.model
        self.cfg = loaded.config
        self.config = config
        self.device = torch.device(config.device)
        cost = None if config.eviction == "lru" else (                 # the isolated prefill's work it saves
            lambda e, cfg=loaded.config: segment_cost(e.origin + e.length, cfg))
        self.segments = TieredStore(self.device, config.segment_cache_bytes, config.host_cache_bytes,
                                    config.disk_cache_dir or None, config.disk_cache_bytes, cost=cost)
        self.prefix = PrefixCache(config.prefix_cache_bytes, loaded.fingerprint)
        self.planner = Planner(loaded.fingerprint, self.segments, self.prefix)
        self.door = Doorkeeper(config.admission_window) if config.admission == "repeat" else None
        self._versions: OrderedDict = OrderedDict()  # (namespace, doc_id) -> the version last requested
        self._invalidated = 0
        tok = loaded.tokenizer                   # end-of-sequence ids: the config's and the tokenizer's
        self.eos = frozenset(self.cfg.eos_token_ids) | frozenset(tok.eos_token_ids if tok else ())
        # sliding windows (rings) and indexed attention (a selection per step) decode over fixed buffers, but compose
        # on the planned paths: the fixed-buffer compose attention takes no window or selection
        planned_compose = any(getattr(m, "window", 0) or getattr(m, "planned_only", False)
                              for m in self.model.mixers.values())
        mode = config.decode_mode
        self.decoder = None if mode == "dynamic" else StaticDecoder(
            self.model, self.device, self.model.lm_head.weight.dtype, graphs=mode == "graph")
        cmode = "eager" if planned_compose else config.compose_mode
        self.composer = None if cmode == "eager" else GraphCompose(
            self.model, self.device, self.model.lm_head.weight.dtype, graphs=cmode == "graph",
            pieces=config.compose_pieces, first_piece=config.compose_first_piece)
        # segment-parallel cold prefill: worker processes with their own copy of the model (last: they start only
        # once everything above has been built)
        self.workers = SegmentWorkers(loaded, config) if config.parallel.enabled else None

    def state_bytes(self, tokens: int) -> int:
        """The bytes a request of `tokens` tokens (prompt and output) holds in its per-layer states at its end: every
        attention layer's keys, values and positions per token, every linear layer's fixed state and conv tail (the
        scheduler's memory admission). Growing buffers may hold up to twice the attention part while they grow."""
        elem = self.model.lm_head.weight.element_size()
        return sum(m.state_bytes(tokens, elem) for m in self.model.mixers.values())

    # -- stage 1: plan -------------------------------------------------------------------------
    def _plan(self, reqs: list[Request]) -> list[PrefillPlan]:
        if self.config.supersede_versions:
            for r in reqs:
                self._supersede(r.prompt)
        return [self.planner.plan(r.prompt, r.policy) for r in reqs]

    # -- the segment store's policies: versions, invalidation, admission ---------------------------
    def _supersede(self, tp) -> None:
        """A tagged document seen at a new version: its entries at other versions go from every tier."""
        for doc in tp.docs:
            if doc is None or not doc[1]:
                continue
            k = (tp.namespace, doc[0])
            last = self._versions.pop(k, None)
            self._versions[k] = doc[1]
            if len(self._versions) > 1 << 20:
                self._versions.popitem(last=False)
            if last is not None and last != doc[1]:
                self.invalidate(doc_id=doc[0], namespace=tp.namespace, keep_version=doc[1])

    def invalidate(self, doc_id: str | None = None, namespace: str | None = None, version: str | None = None,
                   keep_version: str | None = None) -> int:
        """Deletes the segment entries of a document (any version, or `version` only, or all but `keep_version`),
        or of a whole namespace, from every tier; returns how many. A namespace also loses its prefix-cache
        nodes. Running requests keep the entries they already hold."""
        if doc_id is None and namespace is None:
            raise ValueError("invalidate needs a doc_id or a namespace (clear_cache drops everything)")

        def match(k) -> bool:
            return ((namespace is None or k.namespace == namespace) and (doc_id is None or k.doc == doc_id)
                    and (version is None or k.version == version)
                    and (keep_version is None or k.version != keep_version))

        n = self.segments.delete_where(match)
        if doc_id is None:
            self.prefix.drop_namespace(namespace)
        if self.composer is not None:                # its buffers may hold copies of the entries
            self.composer.clear()
        self._invalidated += n
        return n

    @property
    def store_counts(self) -> dict:
        """Entries deleted by invalidation, and cold entries the admission policy did not store."""
        return {"invalidated": self._invalidated, "admission_deferred": self.door.deferred if self.door else 0}

    # -- stage 2: cold prefill (prefix spans of PIC requests, cold segments) -----------------------
    def _cold_prefixes(self, plans: list[PrefillPlan]) -> None:
        todo: dict[str, list[PrefillPlan]] = {}
        for p in plans:
            if p.prefix_cold:
                todo.setdefault(p.boundary_keys[0], []).append(p)
        if not todo:
            return
        keys = list(todo)
        budget = self.config.prefill_chunk_tokens
        sizes = {i: len(todo[k][0].prompt.prefix) for i, k in enumerate(keys)}
        works = []
        for group in chunks(range(len(keys)), sizes, budget):                       # bounded forwards
            builder = BatchBuilder(self.device)
            for i in group:
                prefix = list(todo[keys[i]][0].prompt.prefix)
                *lead, last = _chunk_items([("run", prefix, {"mark": True})], budget)
                st, done = SeqState(capacity_hint=len(prefix)), []
                for part in lead:                   # a prefix longer than the budget: its parts first, alone
                    b = BatchBuilder(self.device)
                    done.append(b.add(st, part, logits="none"))
                    self.model(b.build(walk=self.config.walk))
                works.append((keys[i], prefix, done + [builder.add(st, last, logits="none")]))
            self.model(builder.build(walk=self.config.walk))
        for key, prefix, ws in works:
            (captures,) = _spans([run for w in ws for run in w.runs if run.mark])
            node = self._node(key, None, prefix, 0, captures, todo[key][0].prompt.namespace)
            self.prefix.insert(node)
            for p in todo[key]:
                p.matched = [node]

    def _cold_segments(self, plans: list[PrefillPlan]) -> None:
        distinct, after = {}, {}
        for p in plans:
            for slot in p.cold_slots:
                if slot.key in distinct:
                    continue
                distinct[slot.key] = slot
                # an anchored slot starts from its prefix's cached state (stage 2 made it if it was missing)
                # instead of running the prefix again for every segment
                if slot.anchor and p.matched and p.matched[-1].end == len(slot.anchor):
                    after[slot.key] = p.matched
        slots = list(distinct.values())
        starts = [self._state_from(after[s.key], len(s.anchor) + len(s.tokens)) if s.key in after else None
                  for s in slots]

        def local(idx):
            idx = list(idx)
            tokens = {i: len(slots[i].anchor) + len(slots[i].tokens) for i in idx}
            out = []
            for batch in chunks(idx, tokens, self.config.prefill_chunk_tokens):    # bounded activation memory
                out += prefill_segments(self.model, [slots[i] for i in batch], self.device,
                                        starts=[starts[i] for i in batch], max_tokens=self.config.prefill_chunk_tokens)
            return out

        if self.workers is not None and slots:       # placed over the workers and this rank; same entries
            made = self.workers.prefill(slots, starts, local)
        else:
            made = local(range(len(slots)))
        entries = dict(zip(distinct, made))
        for key, entry in entries.items():
            if self.door is None or self.door.admit(key.id):     # admission "repeat": from the second sighting
                self.segments.put(key, entry)
        for p in plans:
            for slot in p.cold_slots:
                slot.entry = entries[slot.key]

    # -- stage 3: compose pass (all requests in one forward) ---------------------------------------
    def _state_from(self, nodes: list[PrefixNode], capacity: int) -> SeqState:
        """A request's state after its matched prefix nodes; each layer's mixer restores its own part."""
        st = SeqState(length=nodes[-1].end if nodes else 0, capacity_hint=capacity)
        if nodes:
            dtype = self.model.lm_head.weight.dtype
            for l, mixer in self.model.mixers.items():
                st.layers[l] = mixer.restore([n.layers[l] for n in nodes], self.device, dtype, capacity)
        return st

    def _items(self, plan: PrefillPlan) -> list:
        tp, mode = plan.prompt, plan.mode
        if mode is CacheMode.FULL:
            return [("run", tp.token_ids)]
        covered = sum(len(n.tokens) for n in plan.matched)
        if mode is CacheMode.PREFIX:
            spans = plan.boundary_spans
            items = [("run", list(s), {"mark": True}) for s in spans[len(plan.matched):]]
            return items + [("run", list(tp.query))]
        items = [] if covered or not tp.prefix else [("run", list(tp.prefix))]
        for slot in plan.slots:
            if slot.entry is None:
                items.append(("run", list(slot.tokens)))
            else:
                items += [("run", list(slot.tokens[: slot.seam])), ("apply", slot.entry)]
        return items + [("run", list(tp.query))]

    def _compose(self, reqs: list[Request], plans: list[PrefillPlan], defer: bool = False) -> torch.Tensor:
        exact = {r.policy.exact_transition for r in reqs}
        if len(exact) > 1:
            raise ValueError("naive and exact transitions cannot share a forward pass")
        exact = exact.pop()
        builder = BatchBuilder(self.device)
        works, heads = [], []
        for r, p in zip(reqs, plans):
            r.state = self._state_from(p.matched, len(r.prompt) + r.params.max_tokens)
            *lead, last = _chunk_items(self._items(p), self.config.prefill_chunk_tokens)
            done = []
            for part in lead:                   # a long prompt: its leading parts first, one bounded forward each
                b = BatchBuilder(self.device)
                done.append(b.add(r.state, part, logits="none"))
                self.model(b.build(exact_transition=exact, walk=self.config.walk))
            heads.append(done)
            works.append(builder.add(r.state, last))
        logits = None
        if self.composer is not None and len(works) == 1:      # fixed buffers / a replayed graph, if it fits
            logits = self.composer.forward(works[0], builder.ids, builder.pos, exact, defer=defer)
        if logits is None:
            logits = self.model(builder.build(exact_transition=exact, walk=self.config.walk))
        for p, head, w in zip(plans, heads, works):
            if p.mode is CacheMode.PREFIX:
                self._insert_boundaries(p, head + [w])
        return logits

    def _insert_boundaries(self, plan: PrefillPlan, works: list) -> None:
        spans = plan.boundary_spans
        k = len(plan.matched)
        marked = _spans([run for work in works for run in work.runs if run.mark])
        start = sum(len(n.tokens) for n in plan.matched)
        parent = plan.matched[-1].key if plan.matched else None
        for toks, key, captures in zip(spans[k:], plan.boundary_keys[k:], marked):
            node = self._node(key, parent, toks, start, captures, plan.prompt.namespace)
            self.prefix.insert(node)
            parent, start = key, start + len(toks)

    def _node(self, key, parent, tokens, start, captures, namespace: str) -> PrefixNode:
        """A prefix-cache node from a marked run's captures (each mixer's state part after the span)."""
        return PrefixNode(key, parent, tuple(tokens), start, dict(captures), namespace)

    def _counts(self, r: Request, p: PrefillPlan, prefix_reused: bool) -> None:
        """Where each prompt token came from: prefix + composed + recomputed = prompt length."""
        n = len(r.prompt)
        prefix_tokens = sum(len(x.tokens) for x in p.matched) if prefix_reused else 0
        composed = cold = 0
        for slot in p.slots:
            if slot.entry is not None:
                composed += slot.entry.cached_tokens
                if not slot.hit:
                    cold += len(slot.tokens)
        r.counts = dict(prefix_tokens=prefix_tokens, composed_tokens=composed,
                        recomputed_tokens=n - prefix_tokens - composed, cold_prefill_tokens=cold)

    def prefill(self, reqs: list[Request], defer_state: bool = False) -> torch.Tensor:
        """Stages 1-3 for requests sharing one cache policy; returns last-token logits [B, V].
        defer_state: a request composed over the fixed buffers may get its state only at `settle` (so its
        first token is sampled before the state is copied out, and a request that ends there costs no copy);
        the caller then calls settle before anything else runs on the engine."""
        with span("engine.plan"):
            plans = self._plan(reqs)
        prefix_reused = [not p.prefix_cold for p in plans]   # a cold prefix is computed for this request
        with span("engine.cold"):
            self._cold_prefixes(plans)
            self._cold_segments(plans)
        with span("engine.compose"):
            logits = self._compose(reqs, plans, defer_state)
        for r, p, reused in zip(reqs, plans, prefix_reused):
            self._counts(r, p, reused)
        return logits

    def close(self) -> None:
        """Stops the segment-parallel workers, if any (the engine goes on serving with cold prefills on this rank
        only), and waits for the disk tier's queued writes."""
        self.segments.flush()
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    # -- stage 4: decode ----------------------------------------------------------------------------
    def step(self, reqs: list[Request]) -> torch.Tensor:
        """Next-token logits [B, V] of running requests (each has sampled at least one token)."""
        if self.decoder is not None:
            return self.decoder.step(reqs)
        builder = BatchBuilder(self.device)
        for r in reqs:
            builder.add(r.state, [("run", [r.output_ids[-1]])])
        return self.model(builder.build(walk=self.config.walk))

    def extend(self, r: Request, tokens: list[int]) -> torch.Tensor:
        """Teacher-force tokens after the request's prompt; fp32 logits for every one of them."""
        if self.decoder is not None:
            self.decoder.release(r, write_back=True)
        builder = BatchBuilder(self.device)
        builder.add(r.state, [("run", list(tokens))], logits="all")
        return self.model(builder.build(walk=self.config.walk))

    def accept(self, r: Request, logits: torch.Tensor) -> int:
        """Sample the next token of r from its logits, record it and decide whether r stops."""
        token = sample(logits, r.params, r.generator)
        if r.params.return_logits:
            r.logits.append(logits.cpu())
        r.output_ids.append(token)
        p = r.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            r.finish_reason = "stop"
        elif len(r.output_ids) >= p.max_tokens or r.state.length >= self.cfg.max_position_embeddings:
            r.finish_reason = "length"
        return token

    def generate(self, reqs: list[Request], t_start: float | None = None) -> list[RequestOutput]:
        """Prefill, sample and decode requests to the end; each one's TTFT counts from t_start (perf_counter seconds:
        when the prompt came in, LLM.generate's call, so that its checks and tokenization count) to its first token on
        the host (None: now)."""
        t0 = time.perf_counter() if t_start is None else t_start
        for r in reqs:
            r.t_start = t0
        for group in _by_policy(reqs):
            self.begin(group)
        with span("engine.complete"):
            return self.complete(reqs)

    def settle(self, reqs: list[Request], keep_finished: bool = False) -> None:
        """After prefill(..., defer_state=True) and the first tokens: the states of the requests that go on
        (all of them with keep_finished); those that ended at their first token get none."""
        if self.composer is not None:
            self.composer.settle(keep=keep_finished or any(not r.finished for r in reqs))

    def begin(self, reqs: list[Request], keep_states: bool = False) -> torch.Tensor:
        """Prefill requests of one policy (t_start set), sample their first tokens, record TTFT (once the
        first token is on the host); returns the last-token logits [B, V]. keep_states: every request keeps
        its state, also one that ended at its first token (to fork it)."""
        logits = self.prefill(reqs, defer_state=True)
        with span("engine.sample"):
            for r, row in zip(reqs, logits):
                self.accept(r, row)
                r.ttft_s = time.perf_counter() - r.t_start
        self.settle(reqs, keep_finished=keep_states)
        return logits

    def complete(self, reqs: list[Request]) -> list[RequestOutput]:
        """Decode prefilled requests (each has its first token) until every one stops; their outputs."""
        running = [r for r in reqs if not r.finished]
        while running:
            logits = self.step(running)
            for r, row in zip(running, logits):
                self.accept(r, row)
            running = [r for r in running if not r.finished]
        return [self.finish(r) for r in reqs]

    def fork(self, r: Request) -> SeqState:
        """A copy of r's state that another request can continue from while r goes on: KV buffers are
        copied (appends write in place), linear states are new objects over the same tensors (layers
        assign new tensors, never write into given ones)."""
        if self.decoder is not None:
            self.decoder.release(r, write_back=True)
        st = SeqState(length=r.state.length, capacity_hint=r.state.capacity_hint)
        st.layers = {l: s.fork() for l, s in r.state.layers.items()}
        return st

    def finish(self, r: Request) -> RequestOutput:
        """The request's output; releases its state (KV, recurrent states)."""
        tok = self.loaded.tokenizer
        stop = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else self.eos)
        shown = r.output_ids[:-1] if r.finish_reason == "stop" and r.output_ids[-1] in stop else r.output_ids
        text = tok.decode(shown) if tok is not None else None
        if self.decoder is not None:
            self.decoder.release(r)
        r.state = None                                         # release the request's KV and states
        return RequestOutput(prompt_token_ids=r.prompt.token_ids, token_ids=list(r.output_ids), text=text,
                             finish_reason=r.finish_reason, ttft_s=r.ttft_s, mode=r.policy.mode.value,
                             logits=torch.stack(r.logits) if r.logits else None, **r.counts)


def _by_policy(reqs):
    groups: dict = {}
    for r in reqs:
        groups.setdefault(r.policy.exact_transition, []).append(r)
    return list(groups.values())


def _chunk_items(items: list, budget: int) -> list[list]:
    """A request's items cut into consecutive parts of at most `budget` active tokens each (chunked prefill). A run
    may be cut anywhere: the pieces of a marked run (a prefix-cache boundary) are marked too, all but the last as
    `part`, and their captures join again (`_spans`); a summarized run and an apply are never cut. One part (the
    usual case) when the items fit."""
    if sum(len(it[1]) for it in items if it[0] == "run") <= budget:
        return [items]
    parts, cur, n = [], [], 0
    for it in items:
        if it[0] != "run":
            cur.append(it)
            continue
        toks, flags = list(it[1]), (it[2] if len(it) > 2 else {})
        if flags.get("summarize"):
            if cur and n + len(toks) > budget:
                parts.append(cur)
                cur, n = [], 0
            cur.append(it)
            n += len(toks)
            continue
        while toks:
            room = budget - n
            if room <= 0:
                parts.append(cur)
                cur, n, room = [], 0, budget
            piece, toks = toks[:room], toks[room:]
            if flags.get("mark"):
                cur.append(("run", piece, {"mark": True, "part": bool(toks)}))
            else:
                cur.append(("run", piece))
            n += len(piece)
    if cur:
        parts.append(cur)
    return parts


def _spans(marked: list) -> list[dict]:
    """The captures of each boundary span from its marked runs in order: a span cut into parts (`part` runs, then
    its last run) gets its keys, values and positions end to end and its linear states after the last part."""
    out, pending = [], []
    for run in marked:
        pending.append(run)
        if run.part:
            continue
        if len(pending) == 1:
            out.append(run.captures)
        else:
            joined = {}
            for layer, last in pending[-1].captures.items():
                if isinstance(last, KVSpan):
                    ps = [r.captures[layer] for r in pending]
                    joined[layer] = KVSpan(torch.cat([p.k for p in ps]), torch.cat([p.v for p in ps]),
                                           torch.cat([p.pos for p in ps]))
                else:                                   # a linear layer's state (and conv window) after the span
                    joined[layer] = last
            out.append(joined)
        pending = []
    return out

