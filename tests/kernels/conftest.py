"""Kernel tests run the Triton kernels for real: compiled on a CUDA GPU, else through Triton's CPU
interpreter (TRITON_INTERPRET=1, set here before any kernel module is imported by these tests).

Modules imported earlier in the session (by another test directory) were decorated in compiled mode; they
are reloaded so their kernels become interpreted too.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _reload_compiled_kernel_modules() -> None:
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if not name.startswith("kestrel.kernels.") or module is None:
            continue
        if any(type(v) is JITFunction for v in vars(module).values()):
            importlib.reload(module)


if INTERPRET:
    _reload_compiled_kernel_modules()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel inputs live: the interpreter works on CPU tensors, compiled kernels on CUDA ones."""
    return torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")


def pytest_configure(config: pytest.Config) -> None:
    # The interpreter turns 0-d numpy arrays into Python ints the way numpy now deprecates; noise only.
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
