"""The segment store's host and disk tiers (hypic/cache/tiers.py): entries move down when the device tier evicts
them and come back on a hit; the disk tier persists across engines and never serves a file whose bytes do not match
its checksum. An entry goes through its byte form (cache/wire.py) unchanged, so a request composed from a lower
tier's copy gives the same logits, bit for bit, as one composed from the original."""

import os

import pytest
import torch

from hypic import LLM, Prompt, SamplingParams
from hypic.cache.store import MemoryStore
from hypic.cache.tiers import DiskStore, PackedEntry

from .conftest import rand_ids

SP = SamplingParams(max_tokens=3, return_logits=True)


def _prompt(seed=0, n=5, length=60):
    return Prompt(segments=[rand_ids(length, seed + i) for i in range(n)], query=rand_ids(5, seed + 99))


def _equal(a, b):
    assert a.token_ids == b.token_ids
    assert torch.equal(a.logits, b.logits)


@pytest.fixture(scope="module")
def plain():
    return LLM("tiny-qwen3.5")


def _entry_bytes(plain) -> int:
    plain.clear_cache()
    plain.generate([_prompt(0, n=1)], SP)
    return plain.cache_stats()["segments"]["bytes"]


class V:
    """A stored value of n bytes."""

    def __init__(self, n):
        self.nbytes = n


def test_memory_store_reports_what_it_evicts():
    seen = []
    s = MemoryStore(10, on_evict=lambda k, v: seen.append(k))
    for k in "abc":
        s.put(k, V(4))
    assert seen == ["a"] and s.pop("b").nbytes == 4 and s.pop("b") is None
    s.delete("c")
    s.put("d", V(20))                          # refused: nothing evicted
    assert seen == ["a"] and len(s) == 0


def test_memory_store_shrinks_to_a_new_capacity_evicting_as_put_does():
    """set_capacity: the least recent entries go until the rest fit (each reported), later puts keep the new bound,
    and a larger budget evicts nothing; a negative one is refused with the store unchanged."""
    seen = []
    s = MemoryStore(20, on_evict=lambda k, v: seen.append(k))
    for k in "abcd":
        s.put(k, V(4))
    s.get("a")                                 # the most recent now: b goes first
    assert s.set_capacity(9) == 2 and seen == ["b", "c"] and set(s.keys()) == {"d", "a"}
    assert s.stats().capacity_bytes == 9 and s.stats().bytes == 8 and s.stats().evictions == 2
    s.put("e", V(4))                           # over 9: the least recent (d) goes
    assert seen == ["b", "c", "d"] and s.stats().bytes == 8
    assert not s.put("f", V(10))               # over the new budget: refused
    assert s.set_capacity(100) == 0 and s.stats().capacity_bytes == 100
    with pytest.raises(ValueError, match="capacity_bytes"):
        s.set_capacity(-1)
    assert s.stats().capacity_bytes == 100 and len(s) == 2
    s.check()


def test_host_tier_takes_evicted_entries_and_gives_them_back(plain):
    """A device tier of two entries and a host tier: five cold segments leave three on the host; the reordered
    request promotes them back, with no prefill, and composes the same logits bit for bit."""
    one = _entry_bytes(plain)
    p = _prompt(1)
    rev = Prompt(segments=list(p.segments[::-1]), query=p.query)
    plain.clear_cache()
    want = plain.generate([p], SP)[0], plain.generate([rev], SP)[0]
    llm = LLM("tiny-qwen3.5", segment_cache_bytes=2 * one + one // 2, host_cache_bytes=10 * one)
    first = llm.generate([p], SP)[0]
    st = llm.cache_stats()
    assert st["segments"]["entries"] == 2 and st["segments_host"]["entries"] == 3
    _equal(first, want[0])
    second = llm.generate([rev], SP)[0]
    assert second.cold_prefill_tokens == 0 and llm.engine.segments.promotions["host"] >= 3
    _equal(second, want[1])
    llm.engine.segments.check()
    st = llm.cache_stats()
    assert st["segments"]["entries"] + st["segments_host"]["entries"] == 5     # each entry in one tier


def test_disk_tier_persists_across_engines(plain, tmp_path):
    """Engine A writes its entries through to disk; engine B on the same directory (a restart) serves the same
    request with no prefill and the same logits; clear_cache empties the directory."""
    p = _prompt(2)
    plain.clear_cache()
    want = plain.generate([p], SP)[0]
    a = LLM("tiny-qwen3.5", disk_cache_dir=str(tmp_path))
    _equal(a.generate([p], SP)[0], want)
    a.engine.segments.flush()
    assert len(list(tmp_path.glob("*.safetensors"))) == 5
    a.engine.segments.check()
    b = LLM("tiny-qwen3.5", disk_cache_dir=str(tmp_path))
    got = b.generate([p], SP)[0]
    assert got.cold_prefill_tokens == 0 and b.cache_stats()["segments_disk"]["hits"] == 5
    _equal(got, want)
    other = LLM("tiny-qwen3.5", seed=1, disk_cache_dir=str(tmp_path))          # another model: its keys differ
    assert other.generate([p], SP)[0].cold_prefill_tokens == 300
    other.engine.segments.flush()
    assert len(list(tmp_path.glob("*.safetensors"))) == 10
    b.clear_cache()                                                             # b's five files, not the other's
    names = {f.name for f in tmp_path.glob("*.safetensors")}
    assert names == {k.id + ".safetensors" for k in other.engine.segments.keys()}
    other.clear_cache()
    assert not list(tmp_path.glob("*.safetensors"))


@pytest.mark.parametrize("preset", ["tiny-qwen4-exp", "tiny-glm5-next", "tiny-recurrent-gemma", "tiny-zamba2"])
def test_disk_tier_round_trip_of_every_entry_layout(preset, tmp_path):
    """Entries with parts beyond one mixer per layer go through their byte form unchanged: Qwen4-Exp's indexer keys
    (a second attention part per indexed layer, with no values; GLM-5 Next's hold keys and pooling logits), RecurrentGemma's [D, 1, 1] states, Zamba2's block
    attention beside its Mamba2 part. A second engine on the directory serves the request from disk, bit for bit."""
    p = _prompt(4, n=3)
    a = LLM(preset, disk_cache_dir=str(tmp_path))
    want = a.generate([p], SP)[0]
    a.engine.segments.flush()
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    b = LLM(preset, disk_cache_dir=str(tmp_path))
    got = b.generate([p], SP)[0]
    assert got.cold_prefill_tokens == 0 and b.cache_stats()["segments_disk"]["hits"] == 3
    _equal(got, want)


def test_a_damaged_file_is_never_served(plain, tmp_path):
    """One file's bytes flipped, another truncated, a third replaced by garbage: each is a miss (prefilled again,
    counted as corrupt, deleted); the output is unchanged."""
    p = _prompt(3)
    plain.clear_cache()
    want = plain.generate([p], SP)[0]
    a = LLM("tiny-qwen3.5", disk_cache_dir=str(tmp_path))
    a.generate([p], SP)
    a.engine.segments.flush()
    files = sorted(tmp_path.glob("*.safetensors"))
    raw = bytearray(files[0].read_bytes())
    raw[-10] ^= 0xFF                                   # a payload byte
    files[0].write_bytes(bytes(raw))
    files[1].write_bytes(files[1].read_bytes()[:100])
    files[2].write_bytes(b"not a safetensors file")
    (tmp_path / "leftover.tmp").write_bytes(b"x")      # a write cut short: removed at start-up
    b = LLM("tiny-qwen3.5", disk_cache_dir=str(tmp_path))
    assert not (tmp_path / "leftover.tmp").exists()
    got = b.generate([p], SP)[0]
    _equal(got, want)
    disk = b.cache_stats()["segments_disk"]
    assert disk["corrupt"] == 3 and disk["hits"] == 2 and got.cold_prefill_tokens == 180
    b.engine.segments.flush()
    b.engine.segments.check()                          # the three were rewritten from the new prefill
    assert len(list(tmp_path.glob("*.safetensors"))) == 5


def test_disk_budget_evicts_least_recent_and_delete_reaches_every_tier(plain, tmp_path):
    one = _entry_bytes(plain)
    llm = LLM("tiny-qwen3.5", disk_cache_dir=str(tmp_path), disk_cache_bytes=3 * one + one // 2 + 4096,
              host_cache_bytes=10 * one, segment_cache_bytes=2 * one + one // 2)
    p = _prompt(4)
    llm.generate([p], SP)
    seg = llm.engine.segments
    seg.flush()
    disk = llm.cache_stats()["segments_disk"]
    assert disk["entries"] == 3 and disk["evictions"] == 2
    seg.check()
    key = next(iter(seg.keys()))
    assert seg.delete(key) and key not in seg and not seg.delete(key)
    low = next(iter(seg.host.keys()))                  # an entry only below the device, found by its id
    assert low not in seg.mem and seg.delete_id(low.id) and low not in seg and not seg.delete_id(low.id)
    seg.check()
    llm.clear_cache()
    assert not list(tmp_path.glob("*.safetensors")) and len(seg) == 0


def test_packed_entry_digest_and_refusal(plain, tmp_path):
    plain.clear_cache()
    plain.generate([_prompt(5, n=1)], SP)
    (entry,) = plain.engine.segments.values()
    packed = PackedEntry.of(entry, pin=False)
    assert packed.entry(torch.device("cpu")).checksum() == entry.checksum()
    d = DiskStore(tmp_path, capacity_bytes=packed.nbytes // 2)
    assert not d.put(entry.key, packed) and d.stats().rejected == 1
    d.flush()
    assert d.get(entry.key) is None and os.listdir(tmp_path) == []


def test_generate_twice_from_the_command_line_reuses_the_disk_tier(tmp_path):
    """Two processes, one after the other, on one --disk-cache-dir: the second prefills nothing."""
    import json
    import subprocess
    import sys

    args = [sys.executable, "-m", "hypic.cli", "generate", "--segment", "first document " * 6, "--segment",
            "second document " * 5, "--query", "q?", "--max-tokens", "2", "--json", "--disk-cache-dir", str(tmp_path)]
    runs = [subprocess.run(args, capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    one, two = (json.loads(r.stdout) for r in runs)
    assert one["cold_prefill_tokens"] > 0 and two["cold_prefill_tokens"] == 0
    assert one["token_ids"] == two["token_ids"]


def test_cost_aware_eviction_keeps_work_per_byte_and_still_ages():
    """GreedyDual-Size: the value saving the least work per byte goes first (not the least recent); a value that is
    never used again is evicted once the clock (the last victim's priority) has passed it."""
    class V:
        def __init__(self, nbytes, work):
            self.nbytes, self.work = nbytes, work

    s = MemoryStore(30, cost=lambda v: v.work)
    s.put("dear", V(10, 100.0))        # 10 per byte
    s.put("cheap", V(10, 10.0))        # 1 per byte
    s.put("mid", V(10, 50.0))          # 5 per byte
    s.get("cheap")                     # recent, but still the cheapest
    s.put("new", V(10, 40.0))          # 4 per byte: evicts "cheap" (LRU would evict "dear")
    assert "cheap" not in s and "dear" in s
    s.put("n2", V(10, 40.0))           # clock 1 -> priorities dear 10, mid 5, new 5, n2 5: "mid" (oldest of the 5s)
    assert "mid" not in s
    for i in range(4):                 # a stream of 4-per-byte values: each eviction raises the clock by ~4-5 ...
        s.put(f"x{i}", V(10, 40.0))
    assert "dear" not in s             # ... until "dear", never hit again, is the lowest and goes
    s.check()


def test_engine_with_cost_eviction_keeps_long_segments(plain):
    """Through the engine (eviction="cost"), a budget of the long entry and one short one: a 200-token segment,
    then three short ones, one request each. LRU ends with the short ones; cost-aware keeps the long one, which
    saves the most prefill per byte (the short ones' entries are mostly their fixed linear-layer state)."""
    segs = [rand_ids(n, 40 + i) for i, n in enumerate((200, 20, 30, 25))]
    plain.clear_cache()
    plain.generate([Prompt(segments=segs, query=[1])], SamplingParams(max_tokens=1))
    size = {e.length: e.nbytes for e in plain.engine.segments.values()}
    kept = {}
    for eviction in ("lru", "cost"):
        llm = LLM("tiny-qwen3.5", eviction=eviction, segment_cache_bytes=size[200] + size[30] + 1000)
        for seg in segs:
            llm.generate([Prompt(segments=[seg], query=[1])], SamplingParams(max_tokens=1))
        kept[eviction] = sorted(e.length for e in llm.engine.segments.values())
        llm.engine.segments.check()
    assert kept["lru"] == [20, 25, 30] and kept["cost"] == [25, 200]


def test_tiers_show_in_the_server_metrics(tmp_path):
    from prometheus_client import generate_latest

    from hypic.runtime.scheduler import Scheduler, SchedulerConfig
    from hypic.server.metrics import Metrics

    llm = LLM("tiny-qwen3.5", host_cache_bytes=1 << 20, disk_cache_dir=str(tmp_path))
    llm.generate([_prompt(7, n=2)], SP)
    llm.engine.segments.flush()
    text = generate_latest(Metrics(llm, Scheduler(llm.engine, SchedulerConfig())).registry).decode()
    for line in ('hypic_store_entries{store="segments_disk"} 2.0', 'hypic_store_entries{store="segments_host"} 0.0',
                 'hypic_store_entries{store="segments"} 2.0'):
        assert line in text, [x for x in text.splitlines() if "store_entries" in x]
