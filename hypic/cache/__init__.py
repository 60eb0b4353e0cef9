from .entry import AttnKV, LinearSummary, PrefixNode, SegmentEntry, SegmentKey
from .prefix import PrefixCache
from .store import MemoryStore, SegmentStore, StoreStats

__all__ = ["AttnKV", "LinearSummary", "MemoryStore", "PrefixCache", "PrefixNode", "SegmentEntry", "SegmentKey",
           "SegmentStore", "StoreStats"]
