"""The segment store's policies (hypic.md section 4): invalidation by document id / version and by namespace across
every tier, new versions superseding old ones, and the "repeat" admission policy; through the Python API and the
server. Entries recomputed after an invalidation compose the same logits bit for bit (the isolated prefill is
deterministic on the CPU)."""

import pytest
import torch
from fastapi.testclient import TestClient

from hypic import LLM, Prompt, SamplingParams, Segment
from hypic.errors import InvalidRequestError

from .conftest import rand_ids

SP = SamplingParams(max_tokens=2, return_logits=True)


def _docs(seed, tags):
    """Segments of 40 tokens, each tagged (doc_id, version) or untagged (None)."""
    return [rand_ids(40, seed + i) if t is None else Segment(rand_ids(40, seed + i), *t) for i, t in enumerate(tags)]


def _keys(llm):
    return sorted((k.doc, k.version) for k in llm.engine.segments.keys())


@pytest.fixture
def llm():
    return LLM("tiny-qwen3.5", seam=8)


def test_a_tag_is_part_of_the_key_and_invalidation_removes_that_document(llm):
    segs = _docs(0, [("a", None), ("b", "1"), None])
    p = Prompt(segments=segs, query=rand_ids(4, 9))
    want = llm.generate([p], SP)[0]
    assert _keys(llm) == [("", ""), ("a", ""), ("b", "1")]
    # the same text untagged, or under another document, is another entry
    same_text = Prompt(segments=[segs[0].content], query=rand_ids(4, 9))
    assert llm.generate([same_text], SP)[0].cold_prefill_tokens == 40
    assert llm.invalidate(doc_id="b") == 1
    assert _keys(llm) == [("", ""), ("", ""), ("a", "")]
    again = llm.generate([p], SP)[0]
    assert again.cold_prefill_tokens == 40                   # b only
    assert again.token_ids == want.token_ids and torch.equal(again.logits, want.logits)
    assert llm.invalidate(doc_id="nobody") == 0
    assert llm.engine.store_counts["invalidated"] == 1


def test_a_new_version_supersedes_the_old_ones(llm):
    old = Prompt(segments=_docs(10, [("manual", "v1"), ("faq", "v1")]), query=rand_ids(4, 1))
    llm.generate([old], SP)
    new = Prompt(segments=[Segment(rand_ids(50, 77), "manual", "v2")], query=rand_ids(4, 1))
    llm.generate([new], SP)
    assert _keys(llm) == [("faq", "v1"), ("manual", "v2")]
    assert llm.engine.store_counts["invalidated"] == 1
    keep = LLM("tiny-qwen3.5", seam=8, supersede_versions=False)
    keep.generate([old], SP)
    keep.generate([new], SP)
    assert _keys(keep) == [("faq", "v1"), ("manual", "v1"), ("manual", "v2")]
    assert keep.invalidate(doc_id="manual", version="v1") == 1
    assert _keys(keep) == [("faq", "v1"), ("manual", "v2")]


def test_namespace_invalidation_drops_its_segments_and_prefixes_only(llm):
    pa = Prompt(prefix=rand_ids(12, 3), segments=_docs(20, [None, ("d", None)]), query=rand_ids(3, 4), namespace="a")
    pb = Prompt(prefix=rand_ids(12, 3), segments=_docs(20, [None, ("d", None)]), query=rand_ids(3, 4), namespace="b")
    llm.generate([pa, pb], SP)
    assert len(llm.engine.segments) == 4 and len(llm.engine.prefix.store) == 2
    assert llm.invalidate(namespace="a") == 2
    assert {k.namespace for k in llm.engine.segments.keys()} == {"b"}
    assert [n.namespace for n in llm.engine.prefix.store.values()] == ["b"]
    assert llm.generate([pb], SP)[0].cold_prefill_tokens == 0
    assert llm.invalidate(doc_id="d", namespace="b") == 1
    with pytest.raises(ValueError, match="doc_id or a namespace"):
        llm.invalidate()


def test_invalidation_reaches_host_and_disk_tiers_and_a_restarted_engine(tmp_path):
    one_entry = 3 << 20
    a = LLM("tiny-qwen3.5", seam=8, disk_cache_dir=str(tmp_path), host_cache_bytes=64 << 20)
    p = Prompt(segments=_docs(30, [("x", "1"), ("y", "1"), ("x", "1")]), query=rand_ids(4, 5))   # x: two parts
    a.generate([p], SP)
    a.engine.segments.flush()
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    b = LLM("tiny-qwen3.5", seam=8, disk_cache_dir=str(tmp_path), segment_cache_bytes=one_entry)
    assert b.invalidate(doc_id="x") == 2                     # read from the files' headers: b never saw them
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    got = b.generate([p], SP)[0]
    assert got.cold_prefill_tokens == 80                     # both x segments; y came from the disk
    b.engine.segments.check()


def test_admission_repeat_stores_from_the_second_sighting():
    llm = LLM("tiny-qwen3.5", seam=8, admission="repeat", admission_window=2)
    p = Prompt(segments=_docs(40, [None, None]), query=rand_ids(4, 6))
    first = llm.generate([p], SP)[0]
    assert first.cold_prefill_tokens == 80 and len(llm.engine.segments) == 0
    second = llm.generate([p], SP)[0]
    assert second.cold_prefill_tokens == 80 and len(llm.engine.segments) == 2
    third = llm.generate([p], SP)[0]
    assert third.cold_prefill_tokens == 0 and torch.equal(third.logits, first.logits)
    assert llm.engine.store_counts["admission_deferred"] == 2
    # a window of two keys: three one-off segments push the first out, so its next sighting is a first again
    for s in range(3):
        llm.generate([Prompt(segments=_docs(100 + 10 * s, [None]), query=rand_ids(4, 6))], SP)
    llm.generate([Prompt(segments=_docs(100, [None]), query=rand_ids(4, 6))], SP)
    assert len(llm.engine.segments) == 2


@pytest.mark.parametrize("bad,match", [
    (dict(version="2"), "needs a doc_id"),
    (dict(doc_id=""), "non-empty string"),
    (dict(doc_id=5), "non-empty string"),
    (dict(doc_id="x" * 300), "at most 256"),
])
def test_bad_tags_are_refused(bad, match):
    with pytest.raises(InvalidRequestError, match=match):
        Segment([1, 2, 3], **bad)


def test_server_tags_segments_and_invalidates():
    from hypic.server.app import ServerConfig, build_app

    llm = LLM("tiny-qwen3.5", seam=8)
    with TestClient(build_app(llm, ServerConfig(model_name="m"))) as client:
        body = {"model": "m", "prompt": "question?", "max_tokens": 1,
                "segments": ["plain text here, long enough to be cached", {"text": "a tagged document text", "doc_id": "k",
                                                                            "version": "3"}]}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert _keys(llm) == [("", ""), ("k", "3")]
        bad = dict(body, segments=[{"text": "t", "version": "1"}])
        r = client.post("/v1/completions", json=bad)
        assert r.status_code == 400 and "doc_id" in r.text
        r = client.post("/v1/completions", json=dict(body, segments=[{"text": "t", "doc": "typo"}]))
        assert r.status_code in (400, 422)
        chat = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a document sent in a chat message", "segment": True, "doc_id": "c", "version": "1"},
            {"type": "text", "text": "What does it say?"}]}]}
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert ("c", "1") in _keys(llm)
        assert client.post("/admin/invalidate", json={"doc_id": "c"}).json() == {"invalidated": 1}
        assert client.post("/admin/invalidate", json={}).status_code == 400
        r = client.post("/admin/invalidate", json={"doc_id": "k"})
        assert r.status_code == 200 and r.json() == {"invalidated": 1}
        assert _keys(llm) == [("", "")]
        metrics = client.get("/metrics").text
        assert "hypic_store_invalidated_total 2.0" in metrics


def test_admin_calls_run_on_the_engine_thread():
    """The admin endpoints change and walk the engine's stores; they run on the scheduler's engine thread between two
    steps (never beside a prefill or compose pass), their errors reach the caller, and the thread goes on serving."""
    import threading

    from hypic.runtime.scheduler import SchedulerClosedError
    from hypic.server.app import ServerConfig, build_app

    llm = LLM("tiny-qwen3.5", seam=8)
    seen = []
    real = llm.invalidate

    def spy(**kw):
        seen.append(threading.current_thread().name)
        return real(**kw)

    llm.invalidate = spy
    app = build_app(llm, ServerConfig(model_name="m"))
    with TestClient(app) as client:
        body = {"model": "m", "prompt": "question?", "max_tokens": 2,
                "segments": [{"text": "a tagged document text", "doc_id": "k"}]}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/admin/invalidate", json={"doc_id": "k"}).json() == {"invalidated": 1}
        assert seen == ["hypic-scheduler"]
        assert client.get("/admin/segments").json()["data"] == []
        sched = app.state.scheduler
        assert sched.call(lambda: threading.current_thread().name).result(5) == "hypic-scheduler"
        with pytest.raises(ZeroDivisionError):
            sched.call(lambda: 1 / 0).result(5)
        assert client.post("/v1/completions", json=body).status_code == 200          # still serving
    with pytest.raises(SchedulerClosedError):
        sched.call(lambda: None)
