"""The worker's side of KV-cache groups: per-group block tables and slot mappings, graph buffers per group, cache
tensors by spec, the memory plan over every group, FP8 KV scales by checkpoint prefix, and bind-time errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from kestrel.kv_spec import CrossAttentionSpec, FullAttentionSpec, LatentAttentionSpec, SlidingWindowSpec
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.model.attn_metadata import AttentionMetadata
from kestrel.model.layers.attention import Attention
from kestrel.sampling_params import SamplingParams
from kestrel.worker.cuda_graph import GraphBuffers
from kestrel.worker.input_batch import BlockTables, CachedRequestState, build_model_inputs
from kestrel.worker.kv_cache import (
    KVCacheShape,
    allocate_kv_cache,
    bind_layer_caches,
    checkpoint_kv_scales,
    kv_cache_groups,
    kv_scale_key,
)

BS = 16
FULL = FullAttentionSpec(2, 8)
WINDOW = SlidingWindowSpec(2, 8, window=4)


def state(req_id: str, num_tokens: int, computed: int, block_ids: list[list[int]], row: int) -> CachedRequestState:
    return CachedRequestState(req_id, list(range(num_tokens)), num_tokens, SamplingParams(), block_ids, computed,
                              block_table_row=row)


def two_request_step(tables: BlockTables) -> tuple[list[CachedRequestState], list[int]]:
    a_blocks = [[3, 4]] + [[7, 8]] * (len(tables) - 1)
    b_blocks = [[5]] + [[2]] * (len(tables) - 1)
    a = state("a", 20, 18, a_blocks, tables.add(a_blocks))
    b = state("b", 5, 0, b_blocks, tables.add(b_blocks))
    return [a, b], [2, 5]


def test_one_group_builds_todays_inputs() -> None:
    tables = BlockTables(4, 4)
    states, counts = two_request_step(tables)
    inputs = build_model_inputs(states, counts, BS, torch.device("cpu"), tables)
    meta = inputs.attn_metadata
    assert meta.other_groups == () and meta.num_groups == 1
    assert meta.slot_mapping.tolist() == [4 * BS + 2, 4 * BS + 3] + [5 * BS + p for p in range(5)]
    assert meta.block_tables.tolist() == [[3, 4], [5, 0]]  # past b's blocks: never read


def test_each_group_gets_its_slots_and_block_table() -> None:
    tables = BlockTables(4, 4, follows_tokens=[True, True])
    states, counts = two_request_step(tables)
    inputs = build_model_inputs(states, counts, BS, torch.device("cpu"), tables)
    meta = inputs.attn_metadata
    assert meta.num_groups == 2
    assert meta.slot_mapping.tolist() == [4 * BS + 2, 4 * BS + 3] + [5 * BS + p for p in range(5)]
    assert meta.block_tables.tolist() == [[3, 4], [5, 0]]
    second = meta.for_group(1)
    assert second.slot_mapping.tolist() == [8 * BS + 2, 8 * BS + 3] + [2 * BS + p for p in range(5)]
    assert second.block_tables.tolist() == [[7, 8], [2, 0]]
    assert inputs.input_ids.tolist() == [18, 19, 0, 1, 2, 3, 4] and inputs.positions.tolist() == [18, 19, 0, 1, 2, 3, 4]
    with pytest.raises(IndexError, match="group 2"):
        meta.for_group(2)


def test_a_group_without_token_blocks_writes_nowhere() -> None:
    tables = BlockTables(4, 4, follows_tokens=[True, False])
    states, counts = two_request_step(tables)
    meta = build_model_inputs(states, counts, BS, torch.device("cpu"), tables).attn_metadata
    assert meta.for_group(1).slot_mapping.tolist() == [-1] * 7
    with pytest.raises(ValueError, match="first KV-cache group"):
        BlockTables(4, 4, follows_tokens=[False, True])


def test_block_tables_share_rows_and_check_the_group_count() -> None:
    tables = BlockTables(3, 4, follows_tokens=[True, True])
    row = tables.add([[1], [9]])
    tables.append(row, [[2], [8]])
    assert tables[0].gather([row], 2).tolist() == [[1, 2]] and tables[1].gather([row], 2).tolist() == [[9, 8]]
    tables.free(row)
    assert tables.add([[4], [5]]) == row
    with pytest.raises(ValueError, match="1 block lists for 2 KV-cache groups"):
        tables.add([[1]])


def test_graph_buffers_carry_every_group_and_pad_them() -> None:
    tables = BlockTables(4, 4, follows_tokens=[True, True])
    a = state("a", 20, 19, [[3, 4], [7, 8]], tables.add([[3, 4], [7, 8]]))
    b = state("b", 5, 4, [[5], [2]], tables.add([[5], [2]]))
    inputs = build_model_inputs([a, b], [1, 1], BS, torch.device("cpu"), tables)
    buffers = GraphBuffers(8, 4, 4, [1], torch.device("cpu"), num_groups=2)
    buffers.load(inputs, 4)
    meta = buffers.metadata(4)
    second = meta.for_group(1)
    assert meta.slot_mapping.tolist() == [4 * BS + 3, 5 * BS + 4, -1, -1]
    assert second.slot_mapping.tolist() == [8 * BS + 3, 2 * BS + 4, -1, -1]
    assert second.block_tables[:2, :2].tolist() == [[7, 8], [2, 0]] and second.block_tables[2:].eq(0).all()
    one = build_model_inputs([a], [1], BS, torch.device("cpu"), tables)
    buffers.load(one, 4)  # the second row becomes padding again, in every group
    assert second.slot_mapping.tolist() == [8 * BS + 3, -1, -1, -1] and second.block_tables[1].eq(0).all()
    single = build_model_inputs([a], [1], BS, torch.device("cpu"), BlockTables(4, 4))
    with pytest.raises(ValueError, match="1 KV-cache group"):
        buffers.load(single, 4)


def test_cache_tensors_and_bytes_follow_each_spec() -> None:
    latent, cross = LatentAttentionSpec(width=24), CrossAttentionSpec(2, 8, max_encoder_len=40)
    shape = KVCacheShape((FULL, WINDOW, latent, cross), torch.float16, BS)
    caches = allocate_kv_cache(shape, 3, torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == [(2, 3, BS, 2, 8), (2, 3, BS, 2, 8), (3, BS, 24), (2, 3, BS, 2, 8)]
    assert shape.bytes_per_block == sum(c.numel() for c in caches) * 2 // 3
    assert shape.bytes_per_token == (3 * 2 * 2 * 8 + 24) * 2
    groups, layer_groups = kv_cache_groups(shape.layer_specs)
    assert [g.spec for g in groups] == [FULL, WINDOW, latent, cross] and layer_groups == [0, 1, 2, 3]


class LatentAttention(Attention):
    """An attention layer declaring an MLA-style cache, which the attention kernels do not read yet."""

    @property
    def cache_spec(self):
        return LatentAttentionSpec(width=self.head_size)


def test_binding_names_the_group_and_refuses_unsupported_specs() -> None:
    layers = [Attention(4, 8, 2, 0.3, layer_idx=0), Attention(4, 8, 2, 0.3, sliding_window=4, layer_idx=1)]
    shape = KVCacheShape.of_layers(layers, torch.float32, BS)
    groups, layer_groups = kv_cache_groups(shape.layer_specs)
    bind_layer_caches(layers, allocate_kv_cache(shape, 2, torch.device("cpu")), [(0.5, 0.25), (1.0, 1.0)],
                      layer_groups)
    assert [layer.kv_group for layer in layers] == [0, 1] and layers[0].k_scale == 0.5
    latent = LatentAttention(4, 8, 2, 0.3, layer_idx=5)
    with pytest.raises(NotImplementedError, match="layer 5: a latent KV cache.*not supported by the attention backend"):
        latent.bind_kv_cache(torch.zeros(2, 2, BS, 2, 8))


def test_a_second_group_layer_reads_its_own_tables() -> None:
    """Two layers with the same weights and caches, one in group 0 and one in group 1 whose tables point at other
    blocks: with group 1's tables equal to group 0's they agree, and with group 1's slots elsewhere they differ."""
    torch.manual_seed(0)
    layer0, layer1 = Attention(4, 8, 2, 0.3, layer_idx=0), Attention(4, 8, 2, 0.3, layer_idx=1)
    cache0, cache1 = torch.zeros(2, 4, BS, 2, 8), torch.zeros(2, 4, BS, 2, 8)
    layer0.bind_kv_cache(cache0)
    layer1.bind_kv_cache(cache1, group=1)
    q, k, v = torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16)
    base = AttentionMetadata(torch.tensor([16, 17, 18]), torch.tensor([0, 3], dtype=torch.int32),
                             torch.tensor([3], dtype=torch.int32), torch.tensor([[1]], dtype=torch.int32), 3, 3)
    shared = base.sharing_group_tables(2)
    torch.testing.assert_close(layer0(q, k, v, shared), layer1(q, k, v, shared))
    assert torch.equal(cache0, cache1)
    from kestrel.model.attn_metadata import GroupTables

    moved = AttentionMetadata(base.slot_mapping, base.query_start_loc, base.seq_lens, base.block_tables, 3, 3,
                              (GroupTables(torch.tensor([48, 49, 50]), torch.tensor([[3]], dtype=torch.int32)),))
    cache1.zero_()
    torch.testing.assert_close(layer1(q, k, v, moved), layer0(q, k, v, base))
    assert cache1[:, 3, :3].abs().sum() > 0 and cache1[:, 1].abs().sum() == 0


def test_fp8_scales_are_read_by_prefix(tmp_path) -> None:
    write_tiny_checkpoint(str(tmp_path), arch="llama", seed=3)
    save_file({"decoder.blocks.0.attention.k_scale": torch.tensor(0.5),
               "decoder.blocks.1.attention.attn.v_scale": torch.tensor(0.125),
               "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([0.25]),
               "model.layers.0.self_attn.k_scale": torch.tensor(0.75)},
              str(tmp_path / "kv_scales.safetensors"))
    named = [Attention(4, 8, 2, 0.3, layer_idx=0, prefix="decoder.blocks.0.attention"),
             Attention(4, 8, 2, 0.3, layer_idx=1, prefix="decoder.blocks.1.attention")]
    assert [kv_scale_key(layer) for layer in named] == ["decoder.blocks.0.attention", "decoder.blocks.1.attention"]
    assert checkpoint_kv_scales(str(tmp_path), [kv_scale_key(layer) for layer in named]) == [(0.5, 1.0), (1.0, 0.125)]
    llama = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert checkpoint_kv_scales(str(tmp_path), llama) == [(0.75, 1.0), (1.0, 0.25)]
    with pytest.raises(ValueError, match="no checkpoint prefix"):
        kv_scale_key(Attention(4, 8, 2, 0.3, layer_idx=1))
