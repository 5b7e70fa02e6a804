"""Kernel tests run the Triton kernels for real: compiled on a CUDA GPU, else through Triton's CPU
interpreter (TRITON_INTERPRET=1, set here before any kernel module is imported by these tests).

Modules imported earlier in the session (by another test directory) were decorated in compiled mode; they
are reloaded, Triton's own jit library included, so their kernels become interpreted too.
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
    """Re-decorate in interpreter mode whatever was decorated before TRITON_INTERPRET was set: Triton's own
    library functions (tl.sum, tl.max, ...: triton.language.standard/random, then the triton.language
    namespace that re-exports them) and then our kernel modules."""
    from triton.runtime.jit import JITFunction

    def compiled(module) -> bool:
        return module is not None and any(type(v) is JITFunction for v in vars(module).values())

    library = [m for n, m in list(sys.modules.items()) if n.startswith("triton.language.") and compiled(m)]
    for module in library:
        importlib.reload(module)
    if library:
        importlib.reload(sys.modules["triton.language"])
    for name, module in list(sys.modules.items()):
        if name.startswith("kestrel.kernels.") and compiled(module):
            importlib.reload(module)


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language for a launch, walking every member of tl, tl.tensor and
    tl.math, and then again at every call of a @triton.jit helper inside it, though the launch has patched the
    same modules already (a fifth of these tests' interpreter time). A helper whose language modules are patched
    now runs without that walk; the launch still patches them first and restores them at its end."""
    import triton.language as tl
    from triton.runtime import interpreter

    walk = interpreter._patch_lang

    def patch_lang(fn):
        langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        if langs and not any(tl.core.is_builtin(lang.program_id) for lang in langs):
            return interpreter._LangPatchScope()  # patched by the launch: nothing to restore
        return walk(fn)

    interpreter._patch_lang = patch_lang


def _unwrap_shapes_without_rebuilding_them() -> None:
    """Every block type the interpreter makes unwraps its shape; a shape held as a triton.language tuple was
    rebuilt into a new tuple (and a type for it) only to be read as a list: read its values directly, the same list."""
    from triton.language import core

    unwrap = core._unwrap_if_constexpr

    def unwrap_shape(shape):
        values = shape.values if isinstance(shape, core.tuple) else unwrap(shape)
        return [unwrap(s) for s in values]

    core._unwrap_shape = unwrap_shape


def _name_tuple_types_when_asked() -> None:
    """Each tuple the interpreter makes (every block shape) formats its type's name at once, a string that the
    interpreter then never reads: the name is formatted when asked for instead, the same string."""
    from triton.language import core

    def __init__(self, types, fields=None) -> None:
        self.types = types
        self.fields = fields or [""] * len(types)

    def name(self) -> str:
        return "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + "]"

    core.tuple_type.__init__ = __init__
    core.tuple_type.name = property(name)


def _name_block_types_when_asked() -> None:
    """Each block type the interpreter makes (every tensor of every op) formats its name, shape and element type, at
    once, and the shape is a triton.language tuple whose string is built value by value: the name is formatted when
    asked for instead, the same string. (Block types compare by element type and shape, never by name.)"""
    from triton.language import core

    def __init__(self, element_ty, shape) -> None:
        self.element_ty = element_ty
        assert isinstance(shape, (list, core.tuple))
        self.shape = core.tuple(core._unwrap_shape(shape))
        if not self.shape:
            raise TypeError("0d block_type is forbidden")
        self.numel = core.validate_block_shape(self.shape)

    def name(self) -> str:
        return f"<{self.shape}, {self.element_ty}>"

    core.block_type.__init__ = __init__
    core.block_type.name = property(name)


def _type_tuples_when_asked() -> None:
    """Each triton.language tuple (every block shape) builds its type, a tuple type of one constexpr type per value,
    at once, and the interpreter rarely reads it: the type is built from the values when first asked for (a tuple
    that changes a value sets its type anew, as before)."""
    from triton.language import core

    def __init__(self, args, type=None) -> None:
        self.values = [i for i in args]
        if isinstance(type, core.tuple_type):
            self._type = type
        elif type is not None:  # a list or tuple of types
            self._type = core.tuple_type(type)
        else:
            self._type = None

    def get_type(self):
        if self._type is None:
            self._type = core._type_for_tuple_values(self.values)
        return self._type

    def set_type(self, value) -> None:
        self._type = value

    core.tuple.__init__ = __init__
    core.tuple.type = property(get_type, set_type)


def _skip_overflow_checks_that_assert_nothing() -> None:
    """Each integer add, sub and mul of an interpreted kernel redoes itself in int64 and compares the result with the
    int32 bounds (a sixth of the RoPE + KV tests' time), only to hand the comparison to device_assert, which drops it
    unless the options ask for debug (the interpreter's never do). Without debug it now returns at once, as
    device_assert would: the same ops, the same values, no check lost."""
    from triton.language.semantic import TritonSemantic

    sanitize = TritonSemantic.binary_op_sanitize_overflow_impl

    def binary_op_sanitize_overflow_impl(self, lhs, rhs, binary_op) -> None:
        if self.builder.options.debug:
            sanitize(self, lhs, rhs, binary_op)

    TritonSemantic.binary_op_sanitize_overflow_impl = binary_op_sanitize_overflow_impl


def _map_numpy_dtypes_from_one_table() -> None:
    """The interpreter's numpy dtype of a Triton type (asked for by every splat, cast, load and constant) built its
    table of 17 numpy dtypes at each call: the table is built once, the same mapping."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    lookup = interpreter._get_np_dtype
    table = {ty: lookup(ty) for ty in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
                                       tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5,
                                       tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
            if isinstance(tt_dtype, tl.pointer_type):
                return pointer
        found = table.get(tt_dtype)
        return found if found is not None else lookup(tt_dtype)

    interpreter._get_np_dtype = get_np_dtype


if INTERPRET:
    _reload_compiled_kernel_modules()
    _patch_the_language_once_per_launch()
    _unwrap_shapes_without_rebuilding_them()
    _name_tuple_types_when_asked()
    _name_block_types_when_asked()
    _type_tuples_when_asked()
    _skip_overflow_checks_that_assert_nothing()
    _map_numpy_dtypes_from_one_table()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel inputs live: the interpreter works on CPU tensors, compiled kernels on CUDA ones."""
    return torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")


@pytest.fixture(params=[True, False], ids=["features_on", "features_off"])
def launch_features(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Runs a test with the decode-path launch features (kernels/common.py) on, as the tests' default, and off, as a
    GPU without a decode_launches table runs its launchers."""
    from kestrel.kernels import common

    monkeypatch.setattr(common, "launch_feature", lambda name, device: request.param)
    return request.param


def pytest_configure(config: pytest.Config) -> None:
    # The interpreter turns 0-d numpy arrays into Python ints the way numpy now deprecates; noise only.
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
    # exp overflowing to inf in the interpreter's numpy is how the kernels saturate (sigmoid -> 0, tanh -> +-1).
    config.addinivalue_line("filterwarnings", "ignore:overflow encountered in exp:RuntimeWarning")
