"""The offline quantizer reads what to quantize from the model, not from a family's names: a toy family with
its own module names (no `model.layers`, no `_proj`) gets its linear modules, its attention modules' key and value
projections and its SmoothQuant pairs found."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kestrel.config import ConfigError
from kestrel.model.layers.linear import MergedColumnLinear, QKVParallelLinear, RowLinear
from kestrel.quant.calibrate import AttentionTarget, QuantTargets, calibrate, checkpoint_modules, smooth

HIDDEN, HEADS, HEAD = 8, 2, 4


class ToyKestrelBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Module()
        self.mix.wqkv = QKVParallelLinear(HIDDEN, HEAD, HEADS, 1)
        self.mix.wo = RowLinear(HEADS * HEAD, HIDDEN)
        self.ffn = nn.Module()
        self.ffn.w13 = MergedColumnLinear(HIDDEN, [16, 16])
        self.ffn.w2 = RowLinear(16, HIDDEN)


class ToyKestrelModel(nn.Module):
    packed_modules_mapping = {"wqkv": ("wq", "wk", "wv"), "w13": ("w1", "w3")}

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ToyKestrelBlock() for _ in range(2))
        self.head = nn.Linear(HIDDEN, 11)  # no quant method: never a target


def test_targets_come_from_the_models_linear_layers_and_packing():
    with torch.device("meta"):
        targets = QuantTargets.of_model(ToyKestrelModel())
    assert targets.linears == tuple(f"blocks.{i}.{m}" for i in range(2) for m in (
        "mix.wq", "mix.wk", "mix.wv", "mix.wo", "ffn.w1", "ffn.w3", "ffn.w2"))
    assert targets.attention == tuple(AttentionTarget(f"blocks.{i}.mix", f"blocks.{i}.mix.wk", f"blocks.{i}.mix.wv")
                                      for i in range(2))
    assert checkpoint_modules("gate_up_proj", {"gate_up_proj": ("gate_proj", "up_proj")}) == ("gate_proj", "up_proj")
    assert checkpoint_modules("a.o_proj", {"gate_up_proj": ("gate_proj", "up_proj")}) == ("a.o_proj",)


def test_a_model_must_declare_its_packed_modules():
    undeclared = type("Undeclared", (nn.Module,), {})()
    undeclared.blocks = ToyKestrelModel().blocks
    with pytest.raises(ConfigError, match="Undeclared declares no packed_modules_mapping"):
        QuantTargets.of_model(undeclared)


class ScaleNorm(nn.Module):
    def __init__(self, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(HIDDEN) + 0.5)
        self.plus_one = plus_one

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * (1.0 + self.weight) if self.plus_one else x * self.weight


class ToyFloatBlock(nn.Module):
    """The float model as a checkpoint names it (what transformers would build)."""

    def __init__(self, plus_one_ffn_norm: bool) -> None:
        super().__init__()
        self.norm_a = ScaleNorm()
        self.mix = nn.Module()
        for name, rows in (("wq", HEADS * HEAD), ("wk", HEAD), ("wv", HEAD)):
            setattr(self.mix, name, nn.Linear(HIDDEN, rows, bias=False))
        self.mix.wo = nn.Linear(HEADS * HEAD, HIDDEN, bias=False)
        self.norm_b = ScaleNorm(plus_one=plus_one_ffn_norm)
        self.ffn = nn.Module()
        self.ffn.w1, self.ffn.w3 = nn.Linear(HIDDEN, 16, bias=False), nn.Linear(HIDDEN, 16, bias=False)
        self.ffn.w2 = nn.Linear(16, HIDDEN, bias=False)

    def forward(self, x):
        h = self.norm_a(x)
        q, k, v = self.mix.wq(h), self.mix.wk(h), self.mix.wv(h)
        scores = (q.view(*q.shape[:-1], HEADS, HEAD) * k.unsqueeze(-2)).sum(-1).softmax(-1)
        x = x + self.mix.wo((scores.unsqueeze(-1) * v.unsqueeze(-2)).flatten(-2))
        h = self.norm_b(x)
        return x + self.ffn.w2(torch.nn.functional.silu(self.ffn.w1(h)) * self.ffn.w3(h))


class ToyFloatModel(nn.Module):
    def __init__(self, plus_one_ffn_norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, HIDDEN)
        self.blocks = nn.ModuleList(ToyFloatBlock(plus_one_ffn_norm) for _ in range(2))
        self.final_norm = ScaleNorm()
        self.head = nn.Linear(HIDDEN, 32, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


def toy_targets() -> QuantTargets:
    with torch.device("meta"):
        return QuantTargets.of_model(ToyKestrelModel())


def test_calibration_finds_keys_values_and_the_norms_to_smooth_into():
    model = ToyFloatModel().eval()
    samples = [[1, 2, 3, 4, 5], [7, 8, 9]]
    calibration = calibrate(model, samples, torch.device("cpu"), toy_targets())
    assert set(calibration.input_absmax) == set(toy_targets().linears)
    assert set(calibration.key_absmax) == set(calibration.value_absmax) == {"blocks.0.mix", "blocks.1.mix"}
    with torch.no_grad():
        keys = [model.blocks[0].mix.wk(model.blocks[0].norm_a(model.embed(torch.tensor([s])))) for s in samples]
    assert calibration.key_absmax["blocks.0.mix"] == max(float(k.abs().max()) for k in keys)
    # The final norm feeds only the unquantized head: not a SmoothQuant pair.
    assert calibration.norm_feeds == {
        **{f"blocks.{i}.norm_a": (f"blocks.{i}.mix.wq", f"blocks.{i}.mix.wk", f"blocks.{i}.mix.wv") for i in range(2)},
        **{f"blocks.{i}.norm_b": (f"blocks.{i}.ffn.w1", f"blocks.{i}.ffn.w3") for i in range(2)}}
    # Smoothing keeps the float model's function.
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    smooth(weights, calibration, 0.5)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        expected = model(ids)
        model.load_state_dict(weights)
        got = model(ids)
    assert not torch.equal(weights["blocks.0.norm_a.weight"], ToyFloatModel().blocks[0].norm_a.weight.detach())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_one_plus_weight_norm_is_not_smoothed_into():
    calibration = calibrate(ToyFloatModel(plus_one_ffn_norm=True).eval(), [[1, 2, 3]], torch.device("cpu"),
                            toy_targets())
    assert set(calibration.norm_feeds) == {"blocks.0.norm_a", "blocks.1.norm_a"}
