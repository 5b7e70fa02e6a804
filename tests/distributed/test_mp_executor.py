"""The engine over `mp` worker processes against the one-process engine: greedy tokens identical and logprobs
within 1e-5, under chunked prefill and preemption, for TP = 2, PP = 2 and TP = 2 x PP = 2 over the three
architectures, float32 and W8A8 (with pp = 2, two batches in flight); then a killed worker: a clean error,
/health 503, no hang."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kestrel import LLM, SamplingParams
from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server import build_app
from kestrel.executor.base import MultiprocExecutor, WorkerError
from kestrel.fork_server import fork_context
from kestrel.loader.model_init import write_tiny_checkpoint

# A 40-token step budget chunks the 45-token prompt; 10 blocks of 16 tokens cannot hold the four requests at
# full length, so the scheduler preempts (and recomputes) some of them.
ENGINE = dict(device="cpu", dtype="float32", max_num_batched_tokens=40, max_num_seqs=4, kv_cache_blocks=10,
              max_model_len=128, enable_prefix_caching=False, disable_log_stats=True, distributed_timeout_s=60)
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * n) % 1000 + 2 for i in range(n)]} for n in (45, 30, 21, 9)]
PARAMS = SamplingParams(max_tokens=14, temperature=0.0, logprobs=2, ignore_eos=True)
CASES = {  # name -> (arch, tp, pp, quantization[, more engine arguments])
    "llama-tp2": ("llama", 2, 1, None),
    "mistral-pp2": ("mistral", 1, 2, None),
    "qwen2-tp2-pp2-int8": ("qwen2", 2, 2, "int8"),
    "llama-tp2-fp8": ("llama", 2, 1, "fp8"),
    # Experts split by rank through the executor's flag: two whole experts a rank.
    "qwen2_moe-tp2-ep": ("qwen2_moe", 2, 1, None, {"enable_expert_parallel": True}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mp-models")
    for arch in ("llama", "mistral", "qwen2", "qwen2_moe"):
        write_tiny_checkpoint(root / arch, arch, seed=5)
    return root


def generate(model: Path, **engine_args):
    llm = LLM(str(model), **ENGINE, **engine_args)
    try:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return outputs, llm.engine.scheduler.stats
    finally:
        shutdown = getattr(llm.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_workers_match_one_process(models: Path, case: str) -> None:
    arch, tp, pp, quant, *extra = CASES[case]
    expected, expected_stats = generate(models / arch, quantization=quant)
    ours, stats = generate(models / arch, quantization=quant, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                           **(extra[0] if extra else {}))
    assert expected_stats.num_preemptions > 0 and expected_stats.max_batches_in_flight == 0
    if pp == 1:
        assert stats.num_preemptions == expected_stats.num_preemptions and stats.max_batches_in_flight == 0
    else:
        # The batch queue schedules differently (a request waits for its batch in flight), so it preempts at
        # other steps; what it must keep is the tokens.
        assert stats.num_preemptions > 0 and stats.max_batches_in_flight == pp
    for want, got in zip(expected, ours, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for want_lp, got_lp in zip(want.outputs[0].logprobs, got.outputs[0].logprobs, strict=True):
            assert want_lp.keys() == got_lp.keys()
            for token, lp in want_lp.items():
                assert abs(got_lp[token].logprob - lp.logprob) <= 1e-5


def test_ngram_speculation_across_pipeline_stages_is_lossless(models: Path) -> None:
    """A verify step's drafts are the earlier stages' inputs too: they must give way to the accepted tokens there."""
    prompts = [{"prompt_token_ids": ([5, 6, 7, 8, 9] * 6)[:n]} for n in (30, 21)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    runs = {}
    for name, extra in (("plain", {}), ("pp2", {"speculative_config": spec, "pipeline_parallel_size": 2})):
        llm = LLM(str(models / "llama"), **{**ENGINE, "kv_cache_blocks": 40}, **extra)
        try:
            runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.engine.scheduler.stats
        finally:
            shutdown = getattr(llm.runner, "shutdown", None)
            if shutdown is not None:
                shutdown()
    assert stats.num_spec_draft_tokens > 0 and stats.num_spec_accepted_tokens > 0
    assert runs["pp2"] == runs["plain"]


def test_killed_worker_fails_requests_and_health(models: Path) -> None:
    engine = AsyncEngine.from_args(str(models / "llama"), **ENGINE, tensor_parallel_size=2)
    executor = engine.core.runner
    try:
        engine.start()
        client = TestClient(build_app(engine, "tiny"))
        assert client.get("/health").status_code == 200
        os.kill(executor._procs[1].pid, signal.SIGKILL)
        executor._procs[1].join(30)
        health = client.get("/health")
        # The rank and its pid go to the server log; clients learn only that the engine is dead.
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert str(executor._procs[1].pid) not in health.text
        assert "rank 1" in str(engine.error)
        reply = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4})
        assert reply.status_code == 503 and str(executor._procs[1].pid) not in reply.text
        assert not any(p.is_alive() for p in executor._procs)  # the other rank was stopped too
    finally:
        engine.shutdown()


# Rank 0 killed: with pp = 2 the reply rank (the last stage) reports the reset and is waited on; with tp = 2 the
# killed rank is the one waited on, and its peer's report of the reset may arrive first.
@pytest.mark.parametrize("layout", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}], ids=["pp2", "tp2"])
def test_killed_worker_mid_run_is_a_clean_error(models: Path, layout: dict) -> None:
    llm = LLM(str(models / "llama"), **ENGINE, **layout)
    try:
        os.kill(llm.runner._procs[0].pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"rank 0 .* exited with code -9"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        with pytest.raises(WorkerError):  # and every later call, at once
            llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    finally:
        llm.runner.shutdown()


def test_a_rank_reporting_its_peers_death_names_the_dead_peer() -> None:
    """A killed rank's sockets can close, and its peer report the reset, before its own pipe does: the report
    names the killed rank first, and keeps the peer's error. A peer that exited with code 1 (a rank that failed on
    its own error, or on another's) is not blamed; with no peer killed, the error is the rank's own."""
    ctx = fork_context()  # as the executor's CPU ranks: each one's exit is reported by the fork server
    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor._procs = [ctx.Process(target=time.sleep, args=(600,), daemon=True),
                       ctx.Process(target=time.sleep, args=(600,), daemon=True),
                       ctx.Process(target=os._exit, args=(1,), daemon=True)]
    executor._conns = []
    for proc in executor._procs:
        parent, child = ctx.Pipe()
        proc.start()
        child.close()
        executor._conns.append(parent)
    try:
        executor._procs[2].join(30)
        assert executor._root_cause(1, "Connection reset") == "rank 1 failed: Connection reset"
        os.kill(executor._procs[0].pid, signal.SIGKILL)
        # The wait ends at the exit's report: a long grace costs nothing, and a loaded machine may be slow to send it.
        cause = executor._root_cause(1, "Connection reset by peer", 30.0)
        assert re.fullmatch(rf"worker rank 0 \(pid {executor._procs[0].pid}\) exited with code -9 "
                            r"\(then rank 1 failed: Connection reset by peer\)", cause), cause
    finally:
        for proc in executor._procs:
            proc.kill()
            proc.join()
        for conn in executor._conns:
            conn.close()


@contextlib.contextmanager
def call_in_flight(executor: MultiprocExecutor) -> Iterator[None]:
    """The engine thread inside a call (holding the executor's I/O lock) for the block's duration."""
    in_call, leave = threading.Event(), threading.Event()

    def call() -> None:
        with executor._io:
            in_call.set()
            leave.wait(30)

    engine_thread = threading.Thread(target=call)
    engine_thread.start()
    try:
        assert in_call.wait(10)
        yield
    finally:
        leave.set()
        engine_thread.join(10)


def test_a_health_check_leaves_the_pipes_to_a_call_in_flight(models: Path) -> None:
    """/health runs on the server's thread while the engine thread may be inside a call, reading the workers'
    pipes: the check then leaves them alone (the call watches every worker itself), and after the call it finds
    the dead worker and stops the others."""
    llm = LLM(str(models / "llama"), **ENGINE, tensor_parallel_size=2)
    executor = llm.runner
    try:
        with call_in_flight(executor):
            os.kill(executor._procs[1].pid, signal.SIGKILL)
            executor._procs[1].join(10)
            started = time.monotonic()
            assert executor.healthy and time.monotonic() - started < 0.5  # no wait, no read, no close
        assert not executor.healthy
        assert re.search(r"rank 1 .* exited with code -9", str(executor.error))
        assert not any(p.is_alive() for p in executor._procs)
    finally:
        executor.shutdown()


def test_a_shutdown_beside_a_call_in_flight_ends_the_workers_and_leaves_the_pipes(models: Path, monkeypatch) -> None:
    """The server's shutdown gave up waiting for the engine thread, still inside a call: the workers end, but their
    pipes stay open until that call has left them (closed under it, their numbers could go to other files)."""
    monkeypatch.setattr("kestrel.executor.base.SHUTDOWN_WAIT_S", 0.2)
    llm = LLM(str(models / "llama"), **ENGINE, tensor_parallel_size=2)
    executor = llm.runner
    try:
        with call_in_flight(executor):
            executor.shutdown()
            for proc in executor._procs:
                proc.join(10)
                assert proc.exitcode == -signal.SIGKILL
            assert not any(conn.closed for conn in executor._conns)
    finally:
        executor.shutdown()
    assert all(conn.closed for conn in executor._conns)


UNGUARDED_TP_SCRIPT = """
from kestrel import LLM, SamplingParams

print("top level ran", flush=True)
llm = LLM(max_model_len=128, tensor_parallel_size=2, device="cpu")
print("tokens:", *llm.generate("x", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids, flush=True)
"""


def test_a_script_without_a_main_guard_runs_once_under_tensor_parallelism(tmp_path):
    """The ranks start without the program's main module: a script with no `if __name__ == "__main__":` guard runs
    its top level once (not again in each rank, where building its LLM would fail), and generates."""
    import subprocess
    import sys

    script = tmp_path / "unguarded_tp.py"
    script.write_text(UNGUARDED_TP_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("top level ran") == 1, done.stdout
    last = done.stdout.splitlines()[-1].split()
    assert last[0] == "tokens:" and len(last) == 5, done.stdout
