"""Fixtures shared by the unit tests."""

from pathlib import Path

import pytest

from kestrel.loader.model_init import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama checkpoint with its tokenizer; read it, or copy it before changing anything."""
    path = tmp_path_factory.mktemp("unit-llama-tiny")
    write_tiny_checkpoint(str(path), arch="llama", seed=0)
    return path
