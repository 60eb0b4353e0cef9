"""Prometheus metrics (prometheus-client), one registry per server instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, llm, scheduler):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("hypic_time_to_first_token_seconds", "Time to first token, queueing included",
                              buckets=_LAT, registry=r)
        self.tpot = Histogram("hypic_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0), registry=r)
        self.requests = Counter("hypic_requests", "Finished requests by status", ["status"], registry=r)
        self.prompt_tokens = Counter("hypic_prompt_tokens", "Prompt tokens by source (prefix: exact prefix hit, "
                                     "composed: PIC entries, recomputed: forwarded)", ["source"], registry=r)
        self.generated = Counter("hypic_generation_tokens", "Generated tokens", registry=r)
        r.register(_StateCollector(llm, scheduler))

    def observe(self, request, e2e_s: float, status: str) -> None:
        """One finished request (runtime.engine.Request): latency, token sources, status."""
        self.requests.labels(status).inc()
        self.ttft.observe(request.ttft_s)
        n = len(request.output_ids)
        if n > 1:
            self.tpot.observe(max(e2e_s - request.ttft_s, 0.0) / (n - 1))
        for k in ("prefix", "composed", "recomputed"):
            self.prompt_tokens.labels(k).inc(request.counts.get(f"{k}_tokens", 0))
        self.generated.inc(n)


class _StateCollector:
    """Store and queue figures read at scrape time."""

    def __init__(self, llm, scheduler):
        self.llm, self.scheduler = llm, scheduler

    def collect(self):
        stats = self.llm.cache_stats()
        entries = GaugeMetricFamily("hypic_store_entries", "Cached entries", labels=["store"])
        nbytes = GaugeMetricFamily("hypic_store_bytes", "Bytes held by the cache", labels=["store"])
        evictions = CounterMetricFamily("hypic_store_evictions", "Entries evicted", labels=["store"])
        hits = CounterMetricFamily("hypic_store_hits", "Lookups that hit", labels=["store"])
        misses = CounterMetricFamily("hypic_store_misses", "Lookups that missed", labels=["store"])
        for name, s in stats.items():
            entries.add_metric([name], s["entries"])
            nbytes.add_metric([name], s["bytes"])
            evictions.add_metric([name], s["evictions"])
            hits.add_metric([name], s["hits"])
            misses.add_metric([name], s["misses"])
        yield from (entries, nbytes, evictions, hits, misses)
        counts = self.llm.engine.store_counts
        yield CounterMetricFamily("hypic_store_invalidated", "Segment entries deleted by invalidation (document, "
                                  "version or namespace)", value=counts["invalidated"])
        yield CounterMetricFamily("hypic_store_admission_deferred", "Cold segment entries not stored at their first "
                                  "sighting (admission 'repeat')", value=counts["admission_deferred"])
        q = self.scheduler.stats()
        yield GaugeMetricFamily("hypic_queue_length", "Requests waiting for admission", value=q["waiting"])
        yield GaugeMetricFamily("hypic_running_requests", "Requests in the running batch", value=q["running"])
        par = self.llm.parallel_stats()
        if par is not None:                     # segment-parallel cold prefill (hypic/prefill/parallel.py)
            workers = GaugeMetricFamily("hypic_parallel_workers", "Segment-parallel workers by state (ready: gets "
                                        "orders; late: owes entries past a deadline; dead: gets none; restarting: "
                                        "its new process is loading)", labels=["state"])
            for state in ("ready", "late", "dead", "restarting"):
                workers.add_metric([state], len(par[state]))
            segs = CounterMetricFamily("hypic_parallel_segments", "Cold segments by where they were prefilled (local: "
                                       "rank 0's share, remote: a worker, fallback: rank 0 after a worker failed or "
                                       "was late)", labels=["where"])
            for where in ("local", "remote", "fallback"):
                segs.add_metric([where], par[f"{where}_segments"])
            yield workers
            yield segs
            yield CounterMetricFamily("hypic_parallel_received_bytes", "Entry bytes received from workers",
                                      value=par["received_bytes"])
            yield CounterMetricFamily("hypic_parallel_errors", "Orders a worker answered with an error",
                                      value=par["errors"])
            yield CounterMetricFamily("hypic_parallel_restarts", "Workers started again after they died (now serving)",
                                      value=par["restarts"])
