"""One `kestrel serve` process for the whole client suite: the tiny random Llama in float32, behind an API key.
The suite is a package, so the server lives for its modules only (package scope) and this conftest does not
shadow tests/server's, whose modules import theirs as `conftest`."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
import transformers

from kestrel.loader.model_init import write_tiny_checkpoint

from .support import HFModel, Served


def _server_helpers() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "server" / "conftest.py"
    spec = importlib.util.spec_from_file_location("kestrel_server_test_helpers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


_helpers = _server_helpers()


@pytest.fixture(scope="package")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = tmp_path_factory.mktemp("clients-llama-tiny")
    write_tiny_checkpoint(str(model_dir), arch="llama", seed=0)
    with _helpers.serve_process(str(model_dir)) as (_, base_url):
        yield Served(base_url, _helpers.API_KEY, _helpers.MODEL, str(model_dir))


@pytest.fixture(scope="package")
def hf_model(served: Served) -> HFModel:
    tokenizer = transformers.AutoTokenizer.from_pretrained(served.model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32).eval()
    return tokenizer, model


@pytest.fixture(scope="package")
def hf_embed(hf_model: HFModel) -> Callable[[str], np.ndarray]:
    """transformers' embedding of a text as kestrel defines it for a generative model: the final hidden state
    of the last token, L2-normalized."""
    tokenizer, model = hf_model

    def embed(text: str) -> np.ndarray:
        with torch.inference_mode():
            out = model(torch.tensor([tokenizer.encode(text)]), output_hidden_states=True)
        return torch.nn.functional.normalize(out.hidden_states[-1][0, -1], dim=-1).numpy()

    return embed
