"""kestrel-tiny: the small model trained on the Python standard library that ships with kestrel.

`default_model_path()` is the model every command uses when none is given; `kestrel.tiny.corpus` is the stdlib
corpus and its held-out split (the built-in calibration set of `kestrel quantize`, the text of `kestrel bench ppl`).
The training code lives outside the runtime, in the top-level `training.tiny` package; this module stays light so
the CLI can resolve the path cheaply.
"""

from __future__ import annotations

from pathlib import Path

from kestrel.config import ConfigError

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "kestrel-tiny"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def default_model_path() -> Path:
    """The bundled kestrel-tiny directory; ConfigError saying how to get a model when it is not there."""
    missing = [name for name in _REQUIRED_FILES if not (BUNDLED_MODEL_DIR / name).is_file()]
    if missing:
        raise ConfigError(
            f"no model given and the bundled kestrel-tiny model is not installed ({BUNDLED_MODEL_DIR} lacks "
            f"{', '.join(missing)}); pass a Hugging Face model directory (--model DIR, LLM(model=DIR)), train "
            "kestrel-tiny with `python scripts/train_tiny.py --out DIR` (docs/kestrel-tiny.md), or write a "
            "random test model with `kestrel model-init DIR`")
    return BUNDLED_MODEL_DIR
