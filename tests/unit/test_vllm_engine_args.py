"""Every engine argument a vLLM user passes to LLM(...) is honoured or refused by name, never ignored.

The names are vLLM's `EngineArgs` fields (vllm/engine/arg_utils.py) and `LLM.__init__`'s own keywords
(vllm/entrypoints/llm.py), vLLM 0.10-0.11, each with a value that asks for something. `LLM(**kwargs)` builds its
configuration with `EngineConfig.from_kwargs` (the one channel the CLI uses too), so checking it checks both."""

import pytest

from kestrel.config import ENGINE_ARGS, NOT_SUPPORTED_ENGINE_ARGS, ConfigError, EngineConfig
from kestrel.loader.model_init import write_tiny_checkpoint

VLLM_ENGINE_ARGS = {
    "tokenizer": None, "tokenizer_mode": "slow", "skip_tokenizer_init": True, "trust_remote_code": True,
    "download_dir": "/nonexistent-cache", "load_format": "pt", "dtype": "float32", "kv_cache_dtype": "fp8", "seed": 3,
    "max_model_len": 64, "pipeline_parallel_size": 1, "tensor_parallel_size": 1, "data_parallel_size": 2,
    "distributed_executor_backend": "ray", "enable_expert_parallel": True, "block_size": 16,
    "enable_prefix_caching": False, "swap_space": 4, "cpu_offload_gb": 2, "gpu_memory_utilization": 0.5,
    "kv_cache_memory_bytes": 1 << 24, "max_num_batched_tokens": 256, "max_num_seqs": 8, "max_logprobs": 5,
    "logprobs_mode": "processed_logprobs", "disable_log_stats": True, "revision": "v2", "code_revision": "v2",
    "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1e6, "hf_token": "hf_x",
    "hf_overrides": {"rope_theta": 20000.0}, "tokenizer_revision": "v2", "quantization": "fp8",
    "enforce_eager": True, "max_seq_len_to_capture": 4096, "limit_mm_per_prompt": {"image": 1},
    "mm_processor_kwargs": {"a": 1}, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
    "num_gpu_blocks_override": 64, "preemption_mode": "swap", "enable_chunked_prefill": False,
    "speculative_config": {"method": "ngram"}, "guided_decoding_backend": "outlines",
    "structured_outputs_config": {"backend": "guidance"}, "scheduling_policy": "priority",
    "compilation_config": 3, "kv_transfer_config": {"kv_connector": "x"}, "generation_config": "vllm",
    "enable_sleep_mode": True, "calculate_kv_scales": True, "async_scheduling": False, "task": "embed",
    "runner": "pooling", "override_pooler_config": {"pooling_type": "MEAN"}, "enable_prompt_embeds": True,
    "override_generation_config": {"temperature": 0.5}, "served_model_name": "mine",
    "max_parallel_loading_workers": 2, "cuda_graph_sizes": [1, 2, 4], "model_impl": "transformers",
    "long_prefill_token_threshold": 512, "logits_processors": ["my.Processor"], "tokenizer_pool_size": 2,
    "otlp_traces_endpoint": "http://collector:4317",
}
# vLLM arguments kestrel spells differently, accepted under vLLM's name too: the kestrel argument each sets.
VLLM_SPELLINGS = {"num_gpu_blocks_override": "kv_cache_blocks", "override_pooler_config": "pooler_config"}
# What an argument needs beside it to be accepted: the pooler's settings configure the pooling runner; the KV
# scales are measured for an FP8 cache.
COMPANIONS = {"override_pooler_config": {"runner": "pooling"}, "calculate_kv_scales": {"kv_cache_dtype": "fp8"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-args")
    write_tiny_checkpoint(str(path), arch="llama", seed=1)
    return str(path)


@pytest.mark.parametrize("name", sorted(VLLM_ENGINE_ARGS))
def test_each_vllm_engine_argument_is_honoured_or_refused_by_name(model_dir, name):
    ours = {arg.name for arg in ENGINE_ARGS} | set(VLLM_SPELLINGS)
    value = VLLM_ENGINE_ARGS[name]
    if name in ours:
        if name == "download_dir":
            value = model_dir  # a model directory given as such never consults the cache
        companions = COMPANIONS.get(name, {})
        config = EngineConfig.from_kwargs(model_dir, **{name: value}, **companions)
        if name in VLLM_SPELLINGS:
            assert config == EngineConfig.from_kwargs(model_dir, **{VLLM_SPELLINGS[name]: value}, **companions)
        return
    with pytest.raises(ConfigError) as refused:
        EngineConfig.from_kwargs(model_dir, **{name: value})
    message = str(refused.value)
    assert name in message and "not supported" in message and NOT_SUPPORTED_ENGINE_ARGS[name] in message


@pytest.mark.parametrize("name, value", [("swap_space", 0), ("cpu_offload_gb", 0), ("enable_lora", False),
                                         ("speculative_config", None), ("preemption_mode", "recompute"),
                                         ("guided_decoding_backend", "xgrammar"),
                                         ("structured_outputs_config", {"backend": "auto"}),
                                         ("disable_custom_all_reduce", True), ("model_impl", "auto")])
def test_a_vllm_argument_at_its_no_op_value_is_accepted(model_dir, name, value):
    assert EngineConfig.from_kwargs(model_dir, **{name: value}) == EngineConfig.from_kwargs(model_dir)


def test_a_torch_dtype_is_taken_as_its_name(model_dir):
    import torch

    assert EngineConfig.from_kwargs(model_dir, dtype=torch.bfloat16) == EngineConfig.from_kwargs(model_dir,
                                                                                                 dtype="bfloat16")
    with pytest.raises(ConfigError, match="invalid dtype='int8'"):
        EngineConfig.from_kwargs(model_dir, dtype=torch.int8)


def test_a_misspelt_argument_is_an_error_listing_the_known_ones(model_dir):
    with pytest.raises(ConfigError, match="unknown engine argument 'max_num_seq'.*max_num_seqs"):
        EngineConfig.from_kwargs(model_dir, max_num_seq=4)


def test_vllm_spellings_are_the_engine_args_own():
    assert {arg.vllm_name: arg.name for arg in ENGINE_ARGS if arg.vllm_name} == VLLM_SPELLINGS


def test_the_kv_block_count_under_both_names_is_an_error(model_dir):
    config = EngineConfig.from_kwargs(model_dir, num_gpu_blocks_override=64)
    assert config.cache.kv_cache_blocks == 64 and config.cache.num_blocks == 64
    with pytest.raises(ConfigError, match="kv_cache_blocks=64 and num_gpu_blocks_override=32.*give one"):
        EngineConfig.from_kwargs(model_dir, kv_cache_blocks=64, num_gpu_blocks_override=32)
