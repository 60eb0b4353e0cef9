"""Segment-parallel cold prefill (hypic/prefill/parallel.py, hypic.md 2.3) on the CPU: worker processes in a Gloo
group, LPT placement, entries streamed back to rank 0, and every way a worker can fail falling back to rank 0.

The reference is a one-rank engine on the same checkpoint: an entry is built by the same function wherever it is
prefilled, so the outputs agree to the tolerance invariant 4 allows for segments prefilled in other batches (1e-5:
fp32 matmuls blocked differently for another batch composition), and the tokens are equal."""

import time

import pytest
import torch

from hypic import LLM, ParallelConfig, Prompt, SamplingParams
from hypic.config import EngineConfig, ModelConfig
from hypic.errors import ConfigError, WorkerError
from hypic.models.loader import load_model
from hypic.models.presets import preset_config
from hypic.cache import wire
from hypic.prefill.parallel import SegmentWorkers
from hypic.prefill.placement import chunks, lpt, round_robin, segment_cost

from .conftest import rand_ids

ATOL = 1e-5
SP = SamplingParams(max_tokens=4, return_logits=True)


def _prompt(seed=0, lengths=(40, 90, 25, 60, 70), prefix=0):
    return Prompt(prefix=rand_ids(prefix, seed + 50) if prefix else None,
                  segments=[rand_ids(n, seed + i) for i, n in enumerate(lengths)], query=rand_ids(6, seed + 99))


def _par(workers=3, **kw) -> ParallelConfig:
    return ParallelConfig(workers=workers, threads=1, timeout_s=kw.pop("timeout_s", 60.0),
                          startup_timeout_s=120.0, **kw)


def _same(a, b):
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(a.logits, b.logits, atol=ATOL, rtol=0)


def _metrics_show(llm, *lines):
    """The server's Prometheus text (hypic/server/metrics.py) holds these lines."""
    from prometheus_client import generate_latest

    from hypic.runtime.scheduler import Scheduler, SchedulerConfig
    from hypic.server.metrics import Metrics

    text = generate_latest(Metrics(llm, Scheduler(llm.engine, SchedulerConfig())).registry).decode()
    for line in lines:
        assert line in text, (line, [x for x in text.splitlines() if "parallel" in x])


# -- placement -----------------------------------------------------------------------------------------
def test_lpt_places_longest_first_on_the_least_loaded_rank():
    assert lpt([5.0], 3) == [[0], [], []]                       # one segment stays on rank 0
    assert lpt([], 2) == [[], []]
    bins = lpt([7, 5, 4, 3, 3, 2], 2)                            # 12 / 12, where 3 + 3 split by count gives 16 / 8
    loads = [sum([7, 5, 4, 3, 3, 2][i] for i in b) for b in bins]
    assert sorted(loads) == [12, 12] and sorted(i for b in bins for i in b) == list(range(6))
    assert lpt([1, 1, 1, 1], 4) == [[0], [1], [2], [3]]          # ties go to the lower rank, in index order
    with pytest.raises(ValueError):
        lpt([1.0], 0)
    assert round_robin(5, 2) == [[0, 2, 4], [1, 3]]


def test_lpt_against_the_best_split():
    """LPT's makespan is within 4/3 of the optimum (Graham); checked by brute force on random instances."""
    import itertools

    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        costs = (torch.rand(7, generator=g) * 100).tolist()
        best = min(max(sum(c for c, r in zip(costs, a) if r == k) for k in range(3))
                   for a in itertools.product(range(3), repeat=7))
        got = max(sum(costs[i] for i in b) for b in lpt(costs, 3))
        assert got <= best * 4 / 3 + 1e-9


def test_segment_cost_grows_faster_than_length_with_attention_layers():
    cfg = ModelConfig.from_dict(preset_config("tiny-qwen3.5"))
    assert cfg.attention_layers
    a, b = segment_cost(512, cfg), segment_cost(2048, cfg)
    assert b > 4 * a and segment_cost(0, cfg) == 0
    assert chunks([3, 1, 0, 2], [10, 10, 10, 10], 25) == [[3, 1], [0, 2]]
    assert chunks([0, 1], [40, 5], 25) == [[0], [1]]             # a longer segment goes alone


def test_parallel_config_is_validated():
    with pytest.raises(ConfigError):
        ParallelConfig(workers=0)
    with pytest.raises(ConfigError):
        ParallelConfig(workers=3, devices=("cpu",))
    with pytest.raises(ConfigError):
        ParallelConfig(workers=2, spawn=False)                  # hand-started workers need a port to reach
    with pytest.raises(ConfigError):
        ParallelConfig(workers=2, transport="mpi")
    with pytest.raises(ConfigError):
        ParallelConfig(workers=2, placement="random")
    with pytest.raises(ConfigError):
        EngineConfig(parallel={"workers": 2})
    pc = ParallelConfig(workers=3)
    assert pc.worker_device(2, "cuda:0") == "cuda:2" and pc.worker_device(1, "cpu") == "cpu"
    assert pc.data_transport("cuda:0") == "nccl" and pc.data_transport("cpu") == "gloo"


# -- the wire format ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-kimi-linear", "tiny-minimax", "tiny-nemotron-h",
                                    "tiny-lfm2", "tiny-jamba", "tiny-qwen4-exp", "tiny-recurrent-gemma",
                                    "tiny-glm5-next", "tiny-mamba", "tiny-mamba2"])
def test_entry_survives_pack_and_unpack(preset):
    """Every part kind (dense / scalar / diagonal T, conv tails, empty states, K/V) in one flat buffer and back,
    bit for bit, each tensor owning its storage (not a view that pins the whole buffer)."""
    from hypic.cache.entry import SegmentKey
    from hypic.plan.planner import SegmentSlot
    from hypic.prefill.isolated import prefill_segments

    loaded = load_model(preset, EngineConfig())
    slot = SegmentSlot(tuple(rand_ids(40, 1)), 8, SegmentKey("m", "ns", "abc", 8))
    (entry,) = prefill_segments(loaded.model, [slot], torch.device("cpu"))
    meta, payload = wire.pack(entry)
    assert payload.dtype == torch.uint8 and payload.numel() == meta["nbytes"] >= entry.nbytes
    back = wire.unpack(meta, payload.clone())
    assert back.key == entry.key and back.seam_ids == entry.seam_ids and back.length == entry.length
    assert back.checksum() == entry.checksum() and back.nbytes == entry.nbytes
    assert [n for n, _ in back.tensors()] == [n for n, _ in entry.tensors()]
    for (_, t), (_, u) in zip(entry.tensors(), back.tensors()):
        assert u.dtype == t.dtype and u.shape == t.shape and u.is_contiguous()
        assert u.untyped_storage().nbytes() == u.element_size() * u.nelement()
    with pytest.raises(ValueError):
        wire.unpack(meta, payload[:-1])


# -- workers ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    return LLM("tiny-qwen3.5")


def test_parallel_cold_prefill_equals_one_rank(reference):
    """Three ranks: the segments are spread by LPT (rank 0 takes the longest), the entries come back and compose
    to what a one-rank engine gives; the reordered request then hits every entry; `naive` and a prefix work too;
    after close() the LLM goes on alone."""
    p, q = _prompt(0), _prompt(0, prefix=12)
    with LLM("tiny-qwen3.5", parallel=_par(3)) as llm:
        st = llm.parallel_stats()
        assert st["ready"] == [1, 2] and st["transport"] == "gloo"
        out = llm.generate([p], SP)[0]
        _same(out, reference.generate([p], SP)[0])
        assert out.cold_prefill_tokens == 285
        st = llm.parallel_stats()
        assert st["local_segments"] == 1 and st["remote_segments"] == 4 and st["remote_tokens"] == 195
        assert st["orders"] == 2 and st["fallback_segments"] == 0 and st["received_bytes"] > 0
        _metrics_show(llm, 'hypic_parallel_segments_total{where="remote"} 4.0',
                      'hypic_parallel_workers{state="ready"} 2.0')
        rev = Prompt(segments=p.segments[::-1], query=p.query)
        warm = llm.generate([rev], SP)[0]
        assert warm.cold_prefill_tokens == 0 and llm.parallel_stats()["orders"] == 2
        _same(warm, reference.generate([rev], SP)[0])
        _same(llm.generate([q], SP)[0], reference.generate([q], SP)[0])
        llm.set_policy("naive")
        reference.set_policy("naive")
        try:
            _same(llm.generate([p], SP)[0], reference.generate([p], SP)[0])
        finally:
            reference.set_policy("pic")
    assert llm.parallel_stats() is None
    llm.set_policy("pic")
    llm.clear_cache()
    _same(llm.generate([p], SP)[0], reference.generate([p], SP)[0])


def test_batched_requests_share_one_placement(reference):
    """Two requests with overlapping segments: each distinct segment is prefilled once, on some rank."""
    a = _prompt(3)
    b = Prompt(segments=list(a.segments[:2]) + [rand_ids(80, 77)], query=rand_ids(5, 78))
    with LLM("tiny-qwen3.5", parallel=_par(2)) as llm:
        outs = llm.generate([a, b], SP)
        st = llm.parallel_stats()
        assert st["local_segments"] + st["remote_segments"] == 6 and st["remote_segments"] >= 2
        for o, r in zip(outs, reference.generate([a, b], SP)):
            _same(o, r)


@pytest.mark.parametrize("arch", ["kimi_linear", "nemotron_h", "minimax", "zamba2", "qwen4_exp"])
def test_parallel_on_other_families(hf_checkpoints, arch):
    """Checkpoint directories of other families (KDA + MLA, Mamba2 with conv tails, lightning; Zamba2: two stateful
    mixers in a hybrid layer, a shared block reading the embeddings; Qwen4-Exp: indexer keys with no values beside
    each indexed attention layer's): the workers load the same files and their entries compose to the one-rank
    result."""
    path = str(hf_checkpoints[arch][1])
    ref = LLM(path)
    p = _prompt(5, lengths=(30, 50, 20))
    with LLM(path, parallel=_par(2)) as llm:
        _same(llm.generate([p], SP)[0], ref.generate([p], SP)[0])
        assert llm.parallel_stats()["remote_segments"] >= 1


def test_anchored_segments_stay_on_rank_zero(reference):
    """With anchor="prefix" a cold segment starts from its prefix's cached state, which only rank 0 holds."""
    p = _prompt(7, prefix=10)
    reference.set_policy(anchor="prefix")
    try:
        with LLM("tiny-qwen3.5", parallel=_par(2), anchor="prefix") as llm:
            _same(llm.generate([p], SP)[0], reference.generate([p], SP)[0])
            st = llm.parallel_stats()
            assert st["orders"] == 0 and st["local_segments"] == 5
    finally:
        reference.set_policy(anchor="none")
        reference.clear_cache()


def _faulty(fault, timeout_s=60.0, restarts=0, workers=2) -> LLM:
    llm = LLM("tiny-qwen3.5")
    cfg = llm.config.replace(parallel=_par(workers, timeout_s=timeout_s, restarts=restarts))
    llm.engine.workers = SegmentWorkers(llm.engine.loaded, cfg, faults={1: fault})
    return llm


def test_a_worker_that_dies_is_replaced_by_rank_zero(reference):
    """The worker exits on its first order: rank 0 notices (its process is gone), prefills those segments itself,
    and (restarts=0) gives the dead worker nothing more; outputs are unchanged."""
    p, q = _prompt(11), _prompt(12)
    llm = _faulty({"at": 0, "do": "exit"})
    try:
        t0 = time.perf_counter()
        _same(llm.generate([p], SP)[0], reference.generate([p], SP)[0])
        assert time.perf_counter() - t0 < 30                   # noticed by its exit, not by the 60 s deadline
        st = llm.parallel_stats()
        assert st["dead"] == [1] and st["ready"] == [] and st["fallback_segments"] >= 1
        _same(llm.generate([q], SP)[0], reference.generate([q], SP)[0])
        assert llm.parallel_stats()["orders"] == 1
    finally:
        llm.close()


def test_a_worker_that_dies_is_started_again(reference):
    """Three ranks; worker 1 exits on its first order. Rank 0 prefills its segments, starts it again at the next
    prefill (its model loads meanwhile; worker 2 goes on serving in the old group), and once it is up all ranks move
    to a new group: later prefills use both workers again, outputs unchanged; the metrics count the restart."""
    llm = _faulty({"at": 0, "do": "exit"}, restarts=1, workers=3)
    try:
        p = _prompt(31)
        _same(llm.generate([p], SP)[0], reference.generate([p], SP)[0])
        st = llm.parallel_stats()
        assert st["dead"] == [1] and st["fallback_segments"] >= 1 and st["generation"] == 0
        deadline, seed = time.monotonic() + 120, 40
        while llm.parallel_stats()["generation"] == 0:
            assert time.monotonic() < deadline, llm.parallel_stats()
            q = _prompt(seed)                            # every prefill gives rank 0 a chance to start / regroup
            _same(llm.generate([q], SP)[0], reference.generate([q], SP)[0])
            seed += 1
            time.sleep(0.5)
        st = llm.parallel_stats()
        assert st["restarts"] == 1 and st["ready"] == [1, 2] and st["dead"] == [] and st["restarting"] == []
        before = st["remote_segments"]
        r = _prompt(90, lengths=(60, 50, 40, 30, 20, 10))
        _same(llm.generate([r], SP)[0], reference.generate([r], SP)[0])
        st = llm.parallel_stats()
        assert st["remote_segments"] >= before + 2 and st["orders"] >= 3
        _metrics_show(llm, "hypic_parallel_restarts_total 1.0", 'hypic_parallel_workers{state="ready"} 2.0',
                      'hypic_parallel_workers{state="restarting"} 0.0')
    finally:
        llm.close()


def test_a_worker_error_falls_back_and_the_worker_stays(reference):
    """The worker raises on its first order: it answers with an error, rank 0 prefills those segments, and the
    next order goes to the same worker again."""
    p, q = _prompt(13), _prompt(14)
    llm = _faulty({"at": 0, "do": "raise"})
    try:
        _same(llm.generate([p], SP)[0], reference.generate([p], SP)[0])
        st = llm.parallel_stats()
        assert st["errors"] == 1 and st["fallback_segments"] >= 1 and st["ready"] == [1]
        _same(llm.generate([q], SP)[0], reference.generate([q], SP)[0])
        st = llm.parallel_stats()
        assert st["errors"] == 1 and st["orders"] == 2 and st["remote_segments"] >= 1
    finally:
        llm.close()


def test_a_late_worker_is_skipped_until_it_has_answered(reference):
    """The worker stalls past the deadline on its first order: rank 0 prefills those segments; the worker gets no
    order while it owes entries; once its late entries have come (and been dropped) it is used again."""
    p, q = _prompt(15), _prompt(16)
    llm = _faulty({"at": 0, "do": "sleep", "seconds": 4.0}, timeout_s=1.0)
    try:
        _same(llm.generate([p], SP)[0], reference.generate([p], SP)[0])
        st = llm.parallel_stats()
        assert st["late"] == [1] and st["fallback_segments"] >= 1
        time.sleep(6.0)                                        # the late entries arrive
        _same(llm.generate([q], SP)[0], reference.generate([q], SP)[0])
        st = llm.parallel_stats()
        assert st["late_entries"] >= 1 and st["late"] == [] and st["orders"] == 2
    finally:
        llm.close()


def test_workers_must_hold_the_same_model(tmp_path):
    """A hand-started worker (spawn=False, as on another host) with other weights (another seed) is refused at
    start-up with a clear error; so is a model the workers cannot load themselves."""
    import multiprocessing

    from hypic.prefill.parallel import serve

    port = _free_port()
    pc = ParallelConfig(workers=2, spawn=False, port=port, startup_timeout_s=60.0, threads=1)
    proc = multiprocessing.get_context("spawn").Process(
        target=serve, args=("tiny-qwen3.5", EngineConfig(seed=1), 1, pc), daemon=True)
    proc.start()
    try:
        with pytest.raises(WorkerError, match="fingerprint"):
            LLM("tiny-qwen3.5", parallel=pc)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
    from hypic.models.loader import from_tensors

    loaded = load_model("tiny-qwen3.5", EngineConfig())
    ident = from_tensors(loaded.config, {k: v for k, v in loaded.model.state_dict().items()}, EngineConfig(), "t")
    with pytest.raises(WorkerError, match="neither a preset nor a directory"):
        SegmentWorkers(ident, EngineConfig(parallel=_par(2)))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hand_started_worker_from_the_command_line(reference):
    """`hypic worker` (as on another host) joins an engine made with spawn=False, does its share, and exits when
    the engine closes; `hypic generate --workers 2` spawns its own worker and prints the same text."""
    import subprocess
    import sys

    port = _free_port()
    cmd = [sys.executable, "-m", "hypic.cli", "worker", "--model", "tiny-qwen3.5", "--rendezvous", f"127.0.0.1:{port}",
           "--rank", "1", "--workers", "2", "--worker-threads", "1", "--startup-timeout", "120"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        p = _prompt(21)
        pc = ParallelConfig(workers=2, spawn=False, port=port, startup_timeout_s=120.0, timeout_s=60.0)
        with LLM("tiny-qwen3.5", parallel=pc) as llm:
            _same(llm.generate([p], SP)[0], reference.generate([p], SP)[0])
            assert llm.parallel_stats()["remote_segments"] >= 1
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    args = ["generate", "--segment", "one document " * 8, "--segment", "another document " * 6, "--query", "q?",
            "--max-tokens", "3", "--json"]
    one = subprocess.run([sys.executable, "-m", "hypic.cli", *args], capture_output=True, text=True, timeout=300)
    two = subprocess.run([sys.executable, "-m", "hypic.cli", *args, "--workers", "2", "--worker-threads", "1"],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    import json

    assert json.loads(one.stdout)["token_ids"] == json.loads(two.stdout)["token_ids"]
    bad = subprocess.run([sys.executable, "-m", "hypic.cli", "worker", "--rendezvous", "nowhere", "--rank", "1",
                          "--workers", "2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr


def test_a_hand_started_worker_started_again_is_taken_back(reference):
    """Workers on other hosts are started by their operator (`hypic worker`). Worker 1 is killed; rank 0 prefills its
    share itself; a new `hypic worker` for rank 1 (its start counted in the store) loads, and at a later prefill all
    ranks move to a new group: the new worker gets orders, outputs unchanged."""
    import signal
    import subprocess
    import sys

    port = _free_port()
    cmd = [sys.executable, "-m", "hypic.cli", "worker", "--model", "tiny-qwen3.5", "--rendezvous", f"127.0.0.1:{port}",
           "--rank", "1", "--workers", "2", "--worker-threads", "1", "--startup-timeout", "120"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)]
    try:
        pc = ParallelConfig(workers=2, spawn=False, port=port, startup_timeout_s=120.0, timeout_s=5.0)
        with LLM("tiny-qwen3.5", parallel=pc) as llm:
            p = _prompt(61)
            _same(llm.generate([p], SP)[0], reference.generate([p], SP)[0])
            assert llm.parallel_stats()["remote_segments"] >= 1
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait(10)
            q = _prompt(62)
            _same(llm.generate([q], SP)[0], reference.generate([q], SP)[0])
            assert llm.parallel_stats()["dead"] == [1]            # found unreachable: its share went to rank 0
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            deadline, seed = time.monotonic() + 120, 70
            while llm.parallel_stats()["generation"] == 0:
                assert time.monotonic() < deadline and procs[1].poll() is None, llm.parallel_stats()
                r = _prompt(seed)
                _same(llm.generate([r], SP)[0], reference.generate([r], SP)[0])
                seed += 1
                time.sleep(0.5)
            st = llm.parallel_stats()
            assert st["ready"] == [1] and st["restarts"] == 1
            before = st["remote_segments"]
            r = _prompt(95)
            _same(llm.generate([r], SP)[0], reference.generate([r], SP)[0])
            assert llm.parallel_stats()["remote_segments"] > before
        assert procs[1].wait(30) == 0, procs[1].stderr.read()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
