"""The Python API: LLM(model, ...).generate / next_token_logits / score / clear_cache."""

from __future__ import annotations

import importlib
import time

from typing import Sequence

import torch

from .config import CacheMode, CachePolicy, EngineConfig
from .errors import InvalidRequestError
from .models.loader import load_model
from .runtime.engine import Engine, Request
from .runtime.trace import span
from .segment.spans import tokenize_prompt
from .types import Prompt, RequestOutput, SamplingParams


class LLM:
    """A hybrid-attention LLM with position-independent caching.

    model: a checkpoint directory or a preset name (`hypic.models.presets.PRESETS`).
    cache_mode: "pic" | "prefix" | "naive" | "full"; seam: tokens recomputed per reused segment; anchor: what a
    segment's isolated prefill runs after ("none" or "prefix": the request's prefix; CachePolicy.anchor).
    Extra keyword arguments go to EngineConfig (segment_cache_bytes, prefix_cache_bytes, parallel=ParallelConfig(...)
    for segment-parallel cold prefill on worker processes, ...).
    """

    def __init__(self, model: str, *, device: str = "cpu", dtype: str = "float32", cache_mode: str = "pic",
                 seam: int = 8, anchor: str = "none", load_format: str = "auto", seed: int = 0, **engine_kwargs):
        policy = CachePolicy(CacheMode.parse(cache_mode), seam, anchor)
        self.config = EngineConfig(device=device, dtype=dtype, load_format=load_format, seed=seed, policy=policy,
                                   **engine_kwargs)
        self.engine = Engine(load_model(model, self.config), self.config)
        self._n = 0

    @classmethod
    def from_loaded(cls, loaded, config: EngineConfig) -> "LLM":
        """An LLM over an already built model (hypic.models.loader.from_tensors), e.g. weights shared
        with a transformers model in a side-by-side benchmark."""
        self = cls.__new__(cls)
        self.config = config
        self.engine = Engine(loaded, config)
        self._n = 0
        return self

    # -- properties -----------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.loaded.tokenizer

    @property
    def model_config(self):
        return self.engine.cfg

    @property
    def policy(self) -> CachePolicy:
        return self.config.policy

    @property
    def cache_mode(self) -> str:
        return self.policy.mode.value

    def set_policy(self, cache_mode: str | None = None, seam: int | None = None, anchor: str | None = None) -> None:
        """Switch mode / seam / anchor for later requests (caches are kept; entries are keyed by seam and anchor)."""
        self.config = self.config.replace(policy=self.policy.updated(cache_mode, seam, anchor))
        self.engine.config = self.config

    # -- requests -------------------------------------------------------------------------------
    def make_requests(self, prompts, params) -> list[Request]:
        """Validate and tokenize prompts into engine Requests (raises InvalidRequestError, touches no state)."""
        if isinstance(prompts, Prompt):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise InvalidRequestError("no prompts given")
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        cfg = self.engine.cfg
        reqs = []
        for prompt, sp in zip(prompts, plist):
            if not isinstance(sp, SamplingParams):
                raise InvalidRequestError(f"expected SamplingParams, got {type(sp).__name__}")
            tp = tokenize_prompt(prompt, self.tokenizer, vocab_size=cfg.vocab_size,
                                 max_len=cfg.max_position_embeddings, max_segments=self.config.max_segments,
                                 default_namespace=self.config.namespace)
            for t in sp.stop_token_ids:
                if not 0 <= t < cfg.vocab_size:
                    raise InvalidRequestError(f"stop token id {t} is outside the vocabulary")
            gen = None
            if sp.temperature > 0:
                gen = torch.Generator().manual_seed(sp.seed if sp.seed is not None else self.config.seed + self._n)
            self._n += 1
            reqs.append(Request(tp, sp, self.policy, generator=gen))
        return reqs

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        t0 = time.perf_counter()           # TTFT counts from here: the prompt's checks and tokenization are in it
        with span("llm.make_requests"):
            reqs = self.make_requests(prompts, sampling_params)
        return self.engine.generate(reqs, t_start=t0)

    def next_token_logits(self, prompt: Prompt) -> torch.Tensor:
        """fp32 logits [vocab] after the last query token, under the current cache mode."""
        (req,) = self.make_requests([prompt], SamplingParams(max_tokens=1))
        logits = self.engine.prefill([req])[0]
        req.state = None
        return logits.cpu()

    def score(self, prompt: Prompt, continuation) -> list[float]:
        """Teacher-forced log-probabilities of the continuation tokens after the prompt."""
        cont = self._continuation(continuation)
        (req,) = self.make_requests([prompt], SamplingParams(max_tokens=len(cont)))
        self._fits(req, cont)
        first = self.engine.prefill([req])[0]
        out = self._forced(req, first, cont)
        req.state = None
        return out

    def generate_and_score(self, prompt: Prompt, continuation,
                           sampling_params: SamplingParams | None = None) -> tuple[RequestOutput, list[float]]:
        """generate() and score() of one prompt from a single prefill: the state after the prompt is
        forked, one copy teacher-forced through `continuation`, the other decoded. Equal to the two
        calls made separately (tests/test_api.py), at the cost of one prefill."""
        cont = self._continuation(continuation)
        (req,) = self.make_requests([prompt], sampling_params)
        (forked,) = self.make_requests([prompt], SamplingParams(max_tokens=len(cont)))
        self._fits(forked, cont)
        eng = self.engine
        req.t_start = time.perf_counter()
        first = eng.begin([req], keep_states=True)[0]
        forked.state = eng.fork(req)
        logp = self._forced(forked, first, cont)
        forked.state = None
        return eng.complete([req])[0], logp

    def _forced(self, req, first: torch.Tensor, cont: list[int]) -> list[float]:
        rest = self.engine.extend(req, cont[:-1]) if len(cont) > 1 else first.new_empty(0, first.shape[-1])
        logp = torch.log_softmax(torch.cat([first[None], rest]), dim=-1)
        return [float(logp[i, t]) for i, t in enumerate(cont)]

    def _continuation(self, continuation) -> list[int]:
        if isinstance(continuation, str):
            if self.tokenizer is None:
                raise InvalidRequestError("continuation is text but the model has no tokenizer")
            cont = self.tokenizer.encode(continuation)
        else:
            cont = list(continuation)
        if not cont:
            raise InvalidRequestError("the continuation is empty")
        cfg = self.engine.cfg
        for t in cont:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < cfg.vocab_size:
                raise InvalidRequestError(f"continuation token {t!r} is outside the vocabulary")
        return cont

    def _fits(self, req, cont: list[int]) -> None:
        if len(req.prompt) + len(cont) > self.engine.cfg.max_position_embeddings:
            raise InvalidRequestError("prompt plus continuation exceed the model's maximum length")

    def warmup(self, tokens: int = 2048, segments: int = 4, decode_tokens: int = 4) -> dict:
        """Run the engine's paths once on made-up token ids, so that a server's first requests do not pay for
        compiling and tuning its kernels (on the H200 the first cold request took 27-47 s against ~0.7 s after):
        a `full` prefill of `tokens` tokens with a few decode steps, a `pic` request of `segments` segments cold
        (isolated prefills) and then reordered (the compose pass, captured as a CUDA graph where that is the
        mode), and three `prefix` requests: cold, one that misses after its first segment, and a whole-prompt hit
        (H200 run 49: a first hit stalled 1.4 s on the host before its first attention kernel, most likely that
        kernel's compilation for the hit's shapes). Kernels tuned per size bucket (the MoE's, the scan's) and graphs
        captured per shape still tune or capture on the first request of a new bucket. The caches are cleared
        afterwards, so call it before serving. Returns the seconds each part took."""
        if segments < 1 or tokens < 4 * (segments + 1):
            raise InvalidRequestError(f"warm-up needs segments >= 1 and tokens >= 4 * (segments + 1), got "
                                      f"{tokens}, {segments}")
        cfg = self.engine.cfg
        tokens = min(tokens, cfg.max_position_embeddings - decode_tokens - 1)
        g = torch.Generator().manual_seed(self.config.seed)
        ids = torch.randint(1, cfg.vocab_size, (tokens,), generator=g).tolist()
        per = tokens // (segments + 1)
        segs = [ids[i * per:(i + 1) * per] for i in range(segments)]
        query = ids[segments * per:][:max(1, per // 4)]
        sp = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
        old = self.policy
        times = {}
        if self.engine.device.type == "cuda":
            # a long prefix continuation's attention (ops/fast.py, lower-right causal SDPA) imports this module, which
            # imports torch._dynamo: 2.8 s on the first request that needs it (2-core CPU); made here, not there
            importlib.import_module("torch.nn.attention.bias")
        try:
            for mode, prompts in (
                    ("full", [Prompt(query=ids)]),
                    ("pic", [Prompt(segments=segs, query=query), Prompt(segments=segs[::-1], query=query)]),
                    ("prefix", [Prompt(segments=segs, query=query), Prompt(segments=segs[:1] + segs[:0:-1],
                                                                           query=query),
                                Prompt(segments=segs, query=query)])):
                self.set_policy(mode, old.seam)
                t0 = time.perf_counter()
                for p in prompts:
                    self.generate([p], sp)
                times[mode] = time.perf_counter() - t0
        finally:
            self.set_policy(old.mode.value, old.seam)
            self.clear_cache(counters=True)
        return times

    def clear_cache(self, counters: bool = False) -> None:
        """Drops every cached segment and prefix (with counters, also the stores' hit / miss counts)."""
        self.engine.segments.clear(counters)
        self.engine.prefix.clear(counters)
        if self.engine.composer is not None:           # its buffers hold copies of cached entries
            self.engine.composer.clear()

    def invalidate(self, doc_id: str | None = None, namespace: str | None = None, version: str | None = None) -> int:
        """Deletes cached segment entries from every tier (device, host, disk): those of document `doc_id` (tagged
        with hypic.Segment; every version, or `version` only), within `namespace` if given (else in every
        namespace), or, with no doc_id, everything of `namespace` (its prefix-cache nodes too). Returns how many
        segment entries went."""
        return self.engine.invalidate(doc_id=doc_id, namespace=namespace, version=version)

    def parallel_stats(self) -> dict | None:
        """Segment-parallel cold prefill: workers ready / dead / late and counters (None without workers)."""
        w = self.engine.workers
        return w.describe() if w is not None else None

    def close(self) -> None:
        """Stops the engine's worker processes (segment-parallel cold prefill), if any, and waits until the disk tier's
        queued writes are on disk. The LLM stays usable: later cold segments are prefilled in this process. Also
        called on leaving a `with LLM(...) as llm:` block."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cache_stats(self) -> dict:
        """Per store: entries, bytes, capacity, hits, misses, insertions, evictions, rejected; the segment store's host
        and disk tiers, where configured, as "segments_host" and "segments_disk"."""
        return {**self.engine.segments.tier_stats(), "prefix": self.engine.prefix.store.stats().as_dict()}
