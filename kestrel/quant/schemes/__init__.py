"""The built-in quantization schemes, one module each; importing this package imports every module in it, and
each registers its scheme class with `@register_scheme` (so a new scheme is a new file here, no table to edit)."""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
