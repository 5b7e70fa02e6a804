"""The compile-ahead dry runs' layers (`kestrel.worker.dry_layers`): one decoder layer of each kind. The oracle is
what each layer hands the kernels: every `kestrel.ops` call a layer makes in a real forward, with its tensors'
shapes and dtypes and its integer, boolean and string arguments (what Triton specializes on; float arguments,
such as the FP8 KV scales, it does not). The layers kept must make every distinct sequence of such calls that the
whole stack makes, and layers of one kind must make the same one."""

from __future__ import annotations

import functools

import pytest
import torch

from kestrel import ops
from kestrel.config import EngineConfig
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.worker.dry_layers import layer_kind, one_layer_of_each_kind
from kestrel.worker.model_runner import ModelRunner


def arg_summary(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, float):
        return "float"
    if isinstance(value, bool | int | str | type(None) | torch.dtype):
        return value
    if isinstance(value, tuple | list):
        return tuple(arg_summary(v) for v in value)
    return type(value).__name__


def runner_for(tmp_path, arch: str, **overrides) -> ModelRunner:
    write_tiny_checkpoint(str(tmp_path), arch=arch, seed=2, num_hidden_layers=4, **overrides)
    return ModelRunner(EngineConfig.from_kwargs(str(tmp_path), dtype="float32", device="cpu", max_model_len=64,
                                                kv_cache_dtype="fp8", calculate_kv_scales=True))


def prefill_metadata(runner: ModelRunner, n: int) -> AttentionMetadata:
    """One sequence's prefill of `n` tokens (n <= 16) in the cache's first block."""
    return AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=torch.arange(1, dtype=torch.int32)[None],
        max_query_len=n, max_seq_len=n).sharing_group_tables(len(runner.kv_groups))


def calls_per_layer(runner: ModelRunner, monkeypatch) -> dict[int, tuple]:
    """Each decoder layer's `kestrel.ops` calls in one prefill of 12 tokens."""
    stack = runner.model.model
    current: list[int | None] = [None]
    calls: dict[int, list] = {i: [] for i in stack.stage_layers}

    def recording(name, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if current[0] is not None:
                calls[current[0]].append((name, arg_summary(args), tuple(sorted(
                    (k, arg_summary(v)) for k, v in kwargs.items()))))
            return fn(*args, **kwargs)
        return call

    for name in dir(ops):
        fn = getattr(ops, name)
        if not name.startswith("_") and callable(fn) and getattr(fn, "__module__", "").startswith("kestrel"):
            monkeypatch.setattr(ops, name, recording(name, fn))
    hooks = [stack.layers[i].register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i))
             for i in stack.stage_layers]
    hooks.append(stack.norm.register_forward_pre_hook(lambda _m, _a: current.__setitem__(0, None)))
    n = 12
    try:
        with torch.inference_mode():
            runner._run_model(torch.arange(3, 3 + n), torch.arange(n), prefill_metadata(runner, n))
    finally:
        for hook in hooks:
            hook.remove()
    return {i: tuple(c) for i, c in calls.items()}


# Kept: the first layer (no residual stream comes into it) and the first of each kind after it.
@pytest.mark.parametrize("arch,overrides,kept", [
    ("llama", {}, [0, 1]),
    ("gemma3", {}, [0, 1, 2]),  # sliding and global layers, every second one global
    ("qwen3_moe", {"mlp_only_layers": [0]}, [0, 1]),  # a dense MLP first, then experts
    ("qwen3_moe", {"mlp_only_layers": [1]}, [0, 1, 2]),
], ids=["llama", "gemma3", "qwen3-moe-dense-first", "qwen3-moe-dense-second"])
def test_the_kept_layers_make_every_distinct_launch_sequence(tmp_path, monkeypatch, arch, overrides, kept) -> None:
    runner = runner_for(tmp_path, arch, **overrides)
    stack = runner.model.model
    assert len({k for k, v in runner.kv_scales}) > 1  # the layers' FP8 scales differ, and leave the kinds alone
    calls = calls_per_layer(runner, monkeypatch)
    assert all(calls.values())
    with one_layer_of_each_kind(runner.model) as left_out:
        assert list(stack.stage_layers) == kept and left_out == 4 - len(kept)
    assert stack.stage_layers == range(4)  # restored
    assert {calls[i] for i in kept} == set(calls.values())
    by_kind: dict[tuple, set] = {}
    for i in range(1, 4):
        by_kind.setdefault(layer_kind(stack.layers[i]), set()).add(calls[i])
    assert all(len(sequences) == 1 for sequences in by_kind.values())


def test_a_dry_forward_over_the_kept_layers_runs_and_the_stack_comes_back_whole(tmp_path) -> None:
    runner = runner_for(tmp_path, "gemma3")
    stack = runner.model.model
    n = 5
    meta = prefill_metadata(runner, n)
    ran = []
    hooks = [stack.layers[i].register_forward_pre_hook(lambda _m, _a, i=i: ran.append(i)) for i in range(4)]
    with torch.inference_mode(), one_layer_of_each_kind(runner.model):
        out = runner._run_model(torch.arange(3, 3 + n), torch.arange(n), meta)
    for hook in hooks:
        hook.remove()
    assert ran == [0, 1, 2] and out.shape == (n, runner.model.hidden_size)
    with pytest.raises(RuntimeError), one_layer_of_each_kind(runner.model):
        raise RuntimeError("a dry forward failed")
    assert stack.stage_layers == range(4)
