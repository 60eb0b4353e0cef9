"""Exact prefix cache at span boundaries (radix-style): one node per span, keyed by the chain of
all spans before it, holding the KV of the span's tokens plus the linear states and conv windows
at its end (what SGLang's MambaRadixCache keeps for hybrid models)."""

from __future__ import annotations

import hashlib
from typing import Sequence

from .entry import PrefixNode
from .store import MemoryStore
from ..segment.spans import tokens_digest


class PrefixCache:
    def __init__(self, capacity_bytes: int, model_fingerprint: str):
        self.store = MemoryStore(capacity_bytes)
        self.model = model_fingerprint

    def chain_keys(self, namespace: str, spans: Sequence[Sequence[int]], digest=tokens_digest) -> list[str]:
        """digest: a span's tokens_digest (the request's memo of them, where it has one)."""
        keys, parent = [], f"{self.model}|{namespace}"
        for span in spans:
            parent = hashlib.sha256(f"{parent}|{digest(span)}".encode()).hexdigest()
            keys.append(parent)
        return keys

    def match(self, keys: Sequence[str]) -> list[PrefixNode]:
        """The longest run of cached nodes from the first span on. Touches the matched nodes from
        the deepest to the root, so ancestors stay more recent than descendants under LRU."""
        nodes = []
        for k in keys:
            node = self.store.peek(k)
            if node is None:
                break
            nodes.append(node)
        for node in reversed(nodes):
            self.store.get(node.key)
        return nodes

    def insert(self, node: PrefixNode) -> bool:
        return self.store.put(node.key, node)

    def drop_namespace(self, namespace: str) -> int:
        """Deletes every node a request of `namespace` made; returns how many."""
        gone = [k for k, node in self.store.items() if node.namespace == namespace]
        for k in gone:
            self.store.delete(k)
        return len(gone)

    def clear(self, counters: bool = False) -> None:
        self.store.clear(counters)
