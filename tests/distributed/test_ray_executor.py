"""The ray backend on a local Ray cluster started here (one per module: Ray starts slowly): the same tokens and
logprobs as the one-process engine for TP = 2 and PP = 2 (two batches in flight), and a killed actor process is a
clean error."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kestrel import LLM, SamplingParams
from kestrel.executor.base import WorkerError
from kestrel.loader.model_init import write_tiny_checkpoint

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
ENGINE = dict(device="cpu", dtype="float32", max_num_batched_tokens=40, max_num_seqs=4, kv_cache_blocks=10,
              max_model_len=128, enable_prefix_caching=False, disable_log_stats=True, distributed_timeout_s=120)
PROMPTS = [{"prompt_token_ids": [(11 * i + n) % 1000 + 2 for i in range(n)]} for n in (45, 17, 6)]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # The actors import this checkout's kestrel, whatever the environment's install points at.
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ray-model") / "qwen2"
    write_tiny_checkpoint(path, "qwen2", seed=7)
    return path


def run(model: Path, **engine_args):
    llm = LLM(str(model), **ENGINE, **engine_args)
    try:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False), llm.engine.scheduler.stats.max_batches_in_flight
    finally:
        getattr(llm.runner, "shutdown", lambda: None)()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_ray_workers_match_one_process(cluster, model: Path, tp: int, pp: int) -> None:
    expected, _ = run(model)
    ours, in_flight = run(model, distributed_executor_backend="ray", tensor_parallel_size=tp,
                          pipeline_parallel_size=pp)
    assert in_flight == (pp if pp > 1 else 0)  # pp = 2: the batch queue held two batches at once
    for want, got in zip(expected, ours, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for want_lp, got_lp in zip(want.outputs[0].logprobs, got.outputs[0].logprobs, strict=True):
            for token, lp in want_lp.items():
                assert abs(got_lp[token].logprob - lp.logprob) <= 1e-5


def test_killed_ray_worker_is_a_clean_error(cluster, model: Path) -> None:
    llm = LLM(str(model), **ENGINE, distributed_executor_backend="ray", tensor_parallel_size=2)
    try:
        os.kill(llm.runner.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match="a worker failed"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert not llm.runner.healthy
    finally:
        llm.runner.shutdown()
