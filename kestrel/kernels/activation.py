"""MLP activations in one launch: gated `act(gate) * up` on x `[..., 2*I]` (gate then up) -> `[..., I]`, or plain
`act(x)` (GPT-NeoX and Phi-2 style MLPs).

Activations (names as `ACTIVATIONS`; `HF_ACTIVATIONS` maps Hugging Face's `hidden_act` names onto them):
- "silu": `x * sigmoid(x)`.
- "gelu": exact GELU, `0.5 * x * (1 + erf(x / sqrt(2)))` (HF "gelu", torch's default `F.gelu`).
- "gelu_tanh": the tanh approximation `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))` (HF
  "gelu_pytorch_tanh" and "gelu_new", torch's `F.gelu(approximate="tanh")`). The kernel evaluates it as
  `x * sigmoid(2 * inner)`, the same function without the cancellation in `1 + tanh` for negative x.

Computed in fp32 and rounded once to x's dtype (`F.silu(gate) * up` in bf16 rounds twice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import common

_BLOCK = 1024  # output columns per program

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


def activation_code(activation: str) -> int:
    """The `ACTIVATION` constexpr of the kernels for an activation name."""
    try:
        return ACTIVATIONS.index(activation)
    except ValueError:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}") from None


def activate_ref(y: torch.Tensor, activation: str) -> torch.Tensor:
    """act(y) in y's dtype, as torch's functional forms (which Hugging Face's ACT2FN calls) compute it."""
    activation_code(activation)
    if activation == "silu":
        return F.silu(y)
    if activation == "gelu":
        return F.gelu(y)
    return F.gelu(y, approximate="tanh")


def activate_as_kernels_ref(g: torch.Tensor, activation: str) -> torch.Tensor:
    """act(g) of fp32 g with the kernels' own expression where torch's differs in the last bit (SiLU): the
    references of the kernels that take the activation's fp32 value further (quantizers, epilogues)."""
    if activation == "silu":
        return g / (1.0 + torch.exp(-g))
    return activate_ref(g, activation)


def act_mul_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (activate_ref(gate, activation) * up).to(x.dtype)


def act_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    return activate_ref(x.float(), activation).to(x.dtype)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    return act_mul_ref(x, "silu")


# ------------------------------------------------------------------------------------------------ Triton


@triton.jit
def activate(g, ACTIVATION: tl.constexpr):
    """act(g) of fp32 g; ACTIVATION indexes ACTIVATIONS."""
    if ACTIVATION == 0:
        y = g / (1.0 + tl.exp(-g))
    elif ACTIVATION == 1:
        y = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:
        # 0.5 * (1 + tanh(t)) == sigmoid(2 t), t = sqrt(2 / pi) * (g + 0.044715 g^3)
        y = g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * (g * g * g))))
    return y


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr, ACTIVATION: tl.constexpr,
                    GATED: tl.constexpr, USE_PDL: tl.constexpr, FAST: tl.constexpr):
    """One row x BLOCK output columns per program; GATED reads the up half `inter` columns after the gate."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * stride_x
    g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        u = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)  # both loads in flight at once
        y = activate(g, ACTIVATION) * u
    else:
        y = activate(g, ACTIVATION)
    tl.store(out_ptr + row * stride_out + cols, common.to_dtype(y, out_ptr.dtype.element_ty, FAST), mask=mask)


def act_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Triton `act_mul_ref`; rows of x may be strided (last dimension made contiguous if it is not)."""
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"act_mul needs an even last dimension (gate then up), got {width}")
    return _launch(x, width // 2, activation_code(activation), gated=True)


def act(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Triton `act_ref`."""
    return _launch(x, x.shape[-1], activation_code(activation), gated=False)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    return act_mul(x, "silu")


def _launch(x: torch.Tensor, inter: int, code: int, gated: bool) -> torch.Tensor:
    width = x.shape[-1]
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    x2 = x2 if x2.dim() == 2 else x2.reshape(-1, width)
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if out2.numel() > 0:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        _act_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out2, inter, x2.stride(0), out2.stride(0), BLOCK=block, ACTIVATION=code, GATED=gated,
            num_warps=4 if block >= 512 else 1, **common.launch_options(x),
        )
    return out
