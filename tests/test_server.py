"""The HTTP server as users reach it: a real `hypic serve` process on 127.0.0.1, driven by the
official openai client and by raw HTTP."""

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

KEY = "test-key"
MODEL = "tiny-qwen3.5"
DOCS = [f"Document {i}: " + " ".join(f"fact{i}-{j}" for j in range(12)) for i in range(6)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hypic.cli", "serve", "--port", str(port), "--api-key", KEY,
                             "--max-segments", "16", "--seam", "8", "--default-max-tokens", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
        time.sleep(0.1)
    yield base, proc
    proc.send_signal(signal.SIGTERM)
    try:
        # uvicorn shuts down gracefully (the app's lifespan stops the scheduler), then re-raises the
        # signal so process managers see it: exit status 0 or -SIGTERM, with the shutdown logged
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "shut down cleanly" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY)


def _headers():
    return {"Authorization": f"Bearer {KEY}"}


def _stats(base):
    return httpx.get(base + "/health").json()


def test_models_and_health(server):
    base, _ = server
    models = _client(base).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert _stats(base)["status"] == "ok"


def test_rag_reordered_composes_and_matches_full(server):
    base, _ = server
    c = _client(base)
    httpx.post(base + "/admin/clear", headers=_headers())
    q = "\nQuestion: which facts?\nAnswer:"
    first = c.completions.create(model=MODEL, prompt=q, max_tokens=6, temperature=0,
                                 extra_body={"segments": DOCS[:4], "prefix": "Read these.\n"})
    second = c.completions.create(model=MODEL, prompt=q, max_tokens=6, temperature=0,
                                  extra_body={"segments": DOCS[:4][::-1], "prefix": "Read these.\n"})
    h1, h2 = first.usage.model_extra["hypic"], second.usage.model_extra["hypic"]
    assert h2["composed_tokens"] > 0 and h2["recomputed_tokens"] < h1["recomputed_tokens"] + h1["composed_tokens"]
    assert second.usage.prompt_tokens_details.cached_tokens == h2["prefix_tokens"]   # composed is not "cached"
    # seam at least every segment's length: PIC equals full recompute, also through the server
    seam = max(len(d.encode()) for d in DOCS) + 1
    pic = c.completions.create(model=MODEL, prompt=q, max_tokens=8, temperature=0,
                               extra_body={"segments": DOCS[:4][::-1], "seam": seam})
    full = c.completions.create(model=MODEL, prompt=q, max_tokens=8, temperature=0,
                                extra_body={"segments": DOCS[:4][::-1], "cache_mode": "full"})
    assert pic.choices[0].text == full.choices[0].text
    assert full.usage.model_extra["hypic"]["recomputed_tokens"] == full.usage.prompt_tokens
    # anchor "prefix": one document after a prefix is exact at the default seam (its entry was prefilled after it)
    one = {"segments": DOCS[4:5], "prefix": "Read these.\n"}
    anch = c.completions.create(model=MODEL, prompt=q, max_tokens=8, temperature=0,
                                extra_body={**one, "anchor": "prefix"})
    full1 = c.completions.create(model=MODEL, prompt=q, max_tokens=8, temperature=0,
                                 extra_body={**one, "cache_mode": "full"})
    assert anch.usage.model_extra["hypic"]["composed_tokens"] > 0
    assert anch.choices[0].text == full1.choices[0].text


def test_separator_split_equals_segments_field(server):
    base, _ = server
    c = _client(base)
    a = c.completions.create(model=MODEL, prompt="<<PIC_SEP>>".join(DOCS[:2] + ["Q?"]), max_tokens=5, temperature=0)
    b = c.completions.create(model=MODEL, prompt="Q?", max_tokens=5, temperature=0, extra_body={"segments": DOCS[:2]})
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_stream_equals_non_stream(server):
    base, _ = server
    c = _client(base)
    kw = dict(model=MODEL, prompt="Q: tell me", max_tokens=12, temperature=0, extra_body={"segments": DOCS[2:5]})
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": DOCS[0], "segment": True},
                                         {"type": "text", "text": DOCS[1], "segment": True},
                                         {"type": "text", "text": "What is in the documents?"}]}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True)
                       if ch.choices)
    assert streamed == chat.choices[0].message.content
    again = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert again.usage.model_extra["hypic"]["composed_tokens"] > 0
    assert again.choices[0].message.content == chat.choices[0].message.content


def test_32_concurrent_streams(server):
    base, _ = server
    c = _client(base)
    reqs = [dict(prompt=f"Question {i}?", extra_body={"segments": [DOCS[i % 6], DOCS[(i + 1) % 6]]}) for i in range(32)]
    expected = [c.completions.create(model=MODEL, max_tokens=8, temperature=0, **r).choices[0].text for r in reqs]

    async def run():
        ac = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY)

        async def one(r):
            stream = await ac.completions.create(model=MODEL, max_tokens=8, temperature=0, stream=True, **r)
            return "".join([ch.choices[0].text async for ch in stream if ch.choices])

        return await asyncio.gather(*(one(r) for r in reqs))

    got = asyncio.run(run())
    assert got == expected
    s = _stats(base)
    assert s["running"] == 0 and s["waiting"] == 0 and s["request_state_bytes"] == 0


def test_disconnect_mid_stream_releases_the_request(server):
    base, _ = server
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True, "segments": DOCS[:3]}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", base + "/v1/completions", json=body, headers=_headers()) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(x.startswith("data:") for x in got)
            assert _stats(base)["running"] == 1
    for _ in range(100):                       # the server notices and drops the request
        s = _stats(base)
        if s["running"] == 0 and s["request_state_bytes"] == 0:
            break
        time.sleep(0.1)
    assert s["running"] == 0 and s["waiting"] == 0 and s["request_state_bytes"] == 0


BAD = [
    ("malformed JSON", b'{"model": "tiny-qwen3.5", "prompt": ', 400, None),
    ("non-UTF-8", b'{"model": "tiny-qwen3.5", "prompt": "\xff\xfe"}', 400, None),
    ("wrong type", {"model": MODEL, "prompt": "x", "max_tokens": "five"}, 400, "max_tokens"),
    ("wrong type 2", {"model": MODEL, "prompt": 17}, 400, "prompt"),
    ("unknown model", {"model": "gpt-5", "prompt": "x"}, 404, "does not exist"),
    ("max_tokens 0", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens -3", {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("beyond context", {"model": MODEL, "prompt": "x", "max_tokens": 70000}, 400, "context"),
    ("prompt too long", {"model": MODEL, "prompt": "a" * 66000, "max_tokens": 1}, 400, "maximum"),
    ("too many segments", {"model": MODEL, "prompt": "x", "segments": ["d"] * 17}, 400, "too many segments"),
    ("empty segment", {"model": MODEL, "prompt": "x", "segments": ["a", ""]}, 400, "empty"),
    ("empty separator piece", {"model": MODEL, "prompt": "a<<PIC_SEP>><<PIC_SEP>>q"}, 400, "empty"),
    ("n > 1", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n=1"),
    ("bad seam", {"model": MODEL, "prompt": "x", "seam": -1}, 400, "seam"),
    ("bad mode", {"model": MODEL, "prompt": "x", "cache_mode": "magic"}, 400, "cache mode"),
    ("bad anchor", {"model": MODEL, "prompt": "x", "anchor": "start"}, 400, "anchor"),
]


def test_bad_inputs_while_a_valid_request_runs(server):
    base, _ = server
    result = {}

    def valid():
        c = _client(base)
        stream = c.completions.create(model=MODEL, prompt="keep going", max_tokens=300, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True, "segments": DOCS[:2]})
        result["text"] = "".join(ch.choices[0].text for ch in stream if ch.choices)
        result["n"] = True

    t = threading.Thread(target=valid)
    t.start()
    time.sleep(0.3)
    with httpx.Client(timeout=60) as h:
        for name, body, status, needle in BAD:
            if isinstance(body, bytes):
                r = h.post(base + "/v1/completions", content=body,
                           headers={**_headers(), "content-type": "application/json"})
            else:
                r = h.post(base + "/v1/completions", json=body, headers=_headers())
            assert r.status_code == status, (name, r.status_code, r.text)
            err = r.json()["error"]
            assert err["message"], name
            if needle:
                assert needle in err["message"] or needle == err.get("param"), (name, err)
        r = h.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        r = h.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                   headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = h.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=_headers())
        assert r.status_code == 400
        r = h.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                   headers=_headers())
        assert r.status_code == 400
    t.join(timeout=120)
    assert result.get("n") and len(result["text"]) > 0
    assert _stats(base)["status"] == "ok"


def test_metrics_parse_and_move(server):
    base, _ = server

    def scrape():
        text = httpx.get(base + "/metrics").text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    before = scrape()
    c = _client(base)
    c.completions.create(model=MODEL, prompt="Q", max_tokens=3, temperature=0, extra_body={"segments": DOCS[3:5]})
    c.completions.create(model=MODEL, prompt="Q", max_tokens=3, temperature=0, extra_body={"segments": DOCS[3:5][::-1]})
    after = scrape()
    ok = ("hypic_requests_total", (("status", "ok"),))
    assert after[ok] - before.get(ok, 0) == 2
    assert after[("hypic_time_to_first_token_seconds_count", ())] - before[("hypic_time_to_first_token_seconds_count", ())] == 2
    comp = ("hypic_prompt_tokens_total", (("source", "composed"),))
    assert after[comp] > before.get(comp, 0)
    assert after[("hypic_store_entries", (("store", "segments"),))] >= 2
    assert after[("hypic_store_bytes", (("store", "segments"),))] > 0
    assert ("hypic_queue_length", ()) in after and ("hypic_store_evictions_total", (("store", "segments"),)) in after


def test_admin_endpoints(server):
    base, _ = server
    c = _client(base)
    c.completions.create(model=MODEL, prompt="Q", max_tokens=1, extra_body={"segments": [DOCS[5]]})
    segs = httpx.get(base + "/admin/segments", headers=_headers()).json()["data"]
    assert segs and all({"key", "bytes", "cached_tokens"} <= set(s) for s in segs)
    key = segs[0]["key"]
    assert httpx.delete(base + f"/admin/segments/{key}", headers=_headers()).json() == {"deleted": key}
    assert httpx.delete(base + f"/admin/segments/{key}", headers=_headers()).status_code == 404
    assert httpx.post(base + "/admin/clear", headers=_headers()).json() == {"cleared": True}
    st = httpx.get(base + "/admin/stats", headers=_headers()).json()
    assert st["store"]["segments"]["entries"] == 0
    assert httpx.get(base + "/admin/stats").status_code == 401


def test_queue_bound_and_cancel():
    """Scheduler unit: the waiting queue is bounded (the server answers 429 past it)."""
    from hypic import LLM, Prompt, SamplingParams
    from hypic.runtime.scheduler import Job, QueueFullError, Scheduler, SchedulerConfig

    llm = LLM(MODEL)
    sched = Scheduler(llm.engine, SchedulerConfig(max_waiting=2))   # not started: nothing drains the queue
    events = []
    mk = lambda: Job(llm.make_requests([Prompt(query=[1, 2])], [SamplingParams(max_tokens=2)])[0],  # noqa: E731
                     lambda kind, job, payload: events.append(kind))
    sched.submit(mk())
    sched.submit(mk())
    with pytest.raises(QueueFullError):
        sched.submit(mk())
    sched.shutdown()
    assert events == ["error", "error"]


def test_request_timeout_fails_only_that_request():
    """Scheduler unit: a request past its deadline gets a 504 event and leaves the batch; others go on."""
    from hypic import LLM, Prompt, SamplingParams
    from hypic.runtime.scheduler import Job, Scheduler, SchedulerConfig

    llm = LLM(MODEL)
    sched = Scheduler(llm.engine, SchedulerConfig(request_timeout_s=10.0))
    done = threading.Event()
    events = {}

    def on(kind, job, payload):
        events.setdefault(job.id, []).append((kind, payload))
        if kind in ("done", "error") and len([k for v in events.values() for k, _ in v if k in ("done", "error")]) == 2:
            done.set()

    slow = Job(llm.make_requests([Prompt(query=[1, 2])], [SamplingParams(max_tokens=60000, ignore_eos=True)])[0], on)
    quick = Job(llm.make_requests([Prompt(query=[3])], [SamplingParams(max_tokens=2, ignore_eos=True)])[0], on)
    sched.start()
    sched.submit(slow)
    sched.submit(quick)
    assert done.wait(120)
    sched.shutdown()
    assert events[slow.id][-1][0] == "error" and events[slow.id][-1][1][0] == 504
    assert events[quick.id][-1][0] == "done" and len(events[quick.id][-1][1].token_ids) == 2
    assert sched.stats()["running"] == 0


def test_memory_admission_by_state_bytes():
    """Scheduler unit: Engine.state_bytes is what a request's states hold (attention keys, values and positions per
    token, linear states and conv tails); with max_state_bytes room for one request, two requests run one after the
    other, and without it together."""
    from hypic import LLM, Prompt, SamplingParams
    from hypic.runtime.scheduler import Job, Scheduler, SchedulerConfig

    llm = LLM(MODEL)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    out = llm.generate([Prompt(query=list(range(40)))], params)[0]
    req = llm.make_requests([Prompt(query=list(range(40)))], [params])[0]
    llm.engine.prefill([req])
    n = len(req.prompt)
    assert llm.engine.state_bytes(n) <= req.state.nbytes <= 2 * llm.engine.state_bytes(n)
    assert llm.engine.state_bytes(2 * n) > llm.engine.state_bytes(n) > 0
    assert len(out.token_ids) == 4

    def run(bound):
        sched = Scheduler(llm.engine, SchedulerConfig(max_state_bytes=bound))
        done, peak, ended = threading.Event(), [], []

        def on(kind, job, payload):                   # the engine thread: its running list is stable here
            peak.append(len(sched.running))
            if kind in ("done", "error"):
                ended.append(kind)
                if len(ended) == 2:
                    done.set()

        jobs = [Job(llm.make_requests([Prompt(query=list(range(i, i + 30)))], [params])[0], on) for i in (0, 50)]
        for j in jobs:                                # both waiting before the engine thread starts
            sched.submit(j)
        sched.start()
        assert done.wait(60) and ended == ["done", "done"]
        sched.shutdown()
        return max(peak), jobs

    one = llm.engine.state_bytes(34)
    peak, jobs = run(one + one // 2)
    assert peak == 1 and all(j.state_bytes == one for j in jobs)
    assert run(0)[0] == 2


def test_scheduler_config_is_validated():
    from hypic import ConfigError
    from hypic.runtime.scheduler import SchedulerConfig

    for bad in (dict(max_running=0), dict(max_waiting=-1), dict(max_state_bytes=-5), dict(request_timeout_s=0.0),
                dict(max_running_tokens=1.5)):
        with pytest.raises(ConfigError):
            SchedulerConfig(**bad)
    assert SchedulerConfig(max_state_bytes=0).max_state_bytes == 0
