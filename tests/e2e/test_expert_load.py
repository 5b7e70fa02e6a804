"""Expert-load telemetry (`expert_load_metrics`): the counts of a tiny Qwen3-MoE run through `LLM` equal the
routing transformers computes from its own router logits on the same tokens; with the flag off nothing is
counted; a dense model is refused; tensor and expert parallelism over gloo workers give the same totals."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kestrel import LLM, ConfigError, SamplingParams
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.layers.moe import MoEMLP

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, enable_prefix_caching=False, disable_log_stats=True)
PROMPTS = [{"prompt_token_ids": [(5 * i + 3 * n) % 400 + 2 for i in range(n)]} for n in (19, 7, 12)]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("expert-load")
    write_tiny_checkpoint(root / "qwen3_moe", "qwen3_moe", seed=3)
    write_tiny_checkpoint(root / "qwen2_moe", "qwen2_moe", seed=3)
    write_tiny_checkpoint(root / "llama", "llama", seed=3)
    return root


def computed_tokens(outputs) -> list[list[int]]:
    """What the model ran per request: the prompt and every generated token but the last (never fed back)."""
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids[:-1]) for o in outputs]


def hf_expert_load(model_dir: Path, sequences: list[list[int]]) -> dict[int, list[int]]:
    """Each layer's top-k of transformers' router logits over the sequences, counted per expert."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    sparse = [i for i in range(config.num_hidden_layers) if i not in set(getattr(config, "mlp_only_layers", []))]
    load = {i: [0] * config.num_experts for i in sparse}
    with torch.no_grad():
        for tokens in sequences:
            out = hf(torch.tensor([tokens]), output_router_logits=True)
            assert len(out.router_logits) == len(sparse)
            for layer, logits in zip(sparse, out.router_logits):
                ids = torch.topk(logits.reshape(len(tokens), -1), config.num_experts_per_tok, dim=-1).indices
                for expert, count in enumerate(torch.bincount(ids.flatten(), minlength=config.num_experts).tolist()):
                    load[layer][expert] += count
    return load


def run(model_dir: Path, **engine_args):
    llm = LLM(str(model_dir), **ENGINE, **engine_args)
    try:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return outputs, llm.get_expert_load(), llm.stats.expert_load
    finally:
        shutdown = getattr(llm.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_counts_equal_the_hf_routing_of_prefill_and_decode(models: Path, arch: str) -> None:
    outputs, load, reported = run(models / arch, expert_load_metrics=True, max_num_batched_tokens=16, max_num_seqs=4)
    sequences = computed_tokens(outputs)
    assert load == hf_expert_load(models / arch, sequences)
    k = 2
    assert all(sum(counts) == k * sum(map(len, sequences)) for counts in load.values())
    # The engine's copy (the metrics' source) is a report of the same totals, at most expert_load_interval
    # steps old; the first step always reports.
    assert reported.keys() == load.keys()
    assert all(0 < sum(reported[layer]) <= sum(load[layer]) for layer in load)


def test_every_step_reported_with_interval_one(models: Path) -> None:
    _, load, reported = run(models / "qwen3_moe", expert_load_metrics=True, expert_load_interval=1)
    assert reported == load


def test_off_by_default_no_buffer_and_no_api(models: Path) -> None:
    llm = LLM(str(models / "qwen3_moe"), **ENGINE)
    blocks = [m for m in llm.runner.model.modules() if isinstance(m, MoEMLP)]
    assert blocks and all(block.expert_load is None for block in blocks)
    assert llm.runner.expert_counts is None
    llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    assert llm.stats.expert_load == {}
    with pytest.raises(RuntimeError, match="expert_load_metrics=True"):
        llm.get_expert_load()


def test_refused_where_it_would_mean_nothing(models: Path) -> None:
    with pytest.raises(ConfigError, match="expert_load_metrics needs a mixture-of-experts model"):
        LLM(str(models / "llama"), **ENGINE, expert_load_metrics=True)
    with pytest.raises(ConfigError, match="expert_load_interval"):
        LLM(str(models / "qwen3_moe"), **ENGINE, expert_load_interval=4)
    with pytest.raises(ConfigError, match="expert_load_interval"):
        LLM(str(models / "qwen3_moe"), **ENGINE, expert_load_metrics=True, expert_load_interval=0)
    with pytest.raises(ConfigError, match="pipeline_parallel_size=1"):
        LLM(str(models / "qwen3_moe"), **ENGINE, expert_load_metrics=True, pipeline_parallel_size=2)


def test_padding_rows_are_not_counted(models: Path) -> None:
    """A CUDA graph's padding tokens carry slot -1: routed like any token, counted by no expert."""
    llm = LLM(str(models / "qwen3_moe"), **ENGINE, expert_load_metrics=True)
    block = next(m for m in llm.runner.model.modules() if isinstance(m, MoEMLP))
    x = torch.randn(6, llm.runner.model.hidden_size)
    before = block.expert_load.clone()
    with torch.inference_mode():
        block(x, attn_metadata=SimpleNamespace(slot_mapping=torch.tensor([4, 5, 9, -1, -1, -1])))
        _, ids = block.route(x[:3])
    assert (block.expert_load - before).tolist() == torch.bincount(ids.flatten(), minlength=4).tolist()


def test_tensor_and_expert_parallel_workers_give_the_same_totals(models: Path) -> None:
    _, one, _ = run(models / "qwen3_moe", expert_load_metrics=True)
    for expert_parallel in (False, True):
        _, two, reported = run(models / "qwen3_moe", expert_load_metrics=True, tensor_parallel_size=2,
                               enable_expert_parallel=expert_parallel, distributed_timeout_s=60)
        assert two == one, expert_parallel
        assert reported.keys() == one.keys()
