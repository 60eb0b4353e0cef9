"""SQuAD-style answer normalisation, exact match and token F1 (shared by the quality scripts)."""

from __future__ import annotations

import re
import string
from collections import Counter

_PUNCT = set(string.punctuation)


def normalize(s: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(pred: str, gold: str) -> float:
    return float(normalize(pred) == normalize(gold))


def f1(pred: str, gold: str) -> float:
    p, g = normalize(pred).split(), normalize(gold).split()
    if not p or not g:
        return float(p == g)
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    prec, rec = same / len(p), same / len(g)
    return 2 * prec * rec / (prec + rec)
