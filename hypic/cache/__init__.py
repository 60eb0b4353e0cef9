from .entry import AttnKV, KVSpan, LinearSummary, PrefixNode, SegmentEntry, SegmentKey
from .prefix import PrefixCache
from .store import MemoryStore, SegmentStore, StoreStats

__all__ = ["AttnKV", "KVSpan", "LinearSummary", "MemoryStore", "PrefixCache", "PrefixNode", "SegmentEntry", "SegmentKey",
           "SegmentStore", "StoreStats"]
