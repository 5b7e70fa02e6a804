"""Fixtures shared across test folders: speculative decoding's small random checkpoints and proposal recording."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch

from kestrel.executor.base import CPU_RANK_MODULES
from kestrel.fork_server import fork_context
from kestrel.loader.model_init import write_eagle_head, write_tiny_checkpoint


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's workers share the cores: each gets its share of torch's threads, so that their pools do not
    # oversubscribe them (an engine built in a test still sets its own count)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))
    # Whichever test first starts this process's fork server (a worker pool or a CPU `mp` executor), it imports the
    # executor's worker modules too: the CPU engines of later tests then fork their ranks without importing torch.
    fork_context(CPU_RANK_MODULES)
    _one_ssl_context_for_every_client()


def _one_ssl_context_for_every_client() -> None:
    """Every httpx client (the openai, LangChain and litellm clients' too) loads the CA bundle into an SSL context
    of its own when it is built: ~38 ms of CPU on the 2-core machine, even for an http:// URL. The tests' servers
    speak plain HTTP, so the clients built with the default verification share one context, built once."""
    from httpx._transports import default

    create = default.create_ssl_context
    shared: dict[bool, Any] = {}

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in shared:
            shared[trust_env] = create(verify=verify, cert=cert, trust_env=trust_env)
        return shared[trust_env]

    default.create_ssl_context = create_ssl_context


# The client suite's modules share one package-scoped `kestrel serve`, which pytest stops whenever a worker turns to
# another package: under xdist they run on one worker, one after another.
PACKAGE_SCOPED = "tests/clients/"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` (each file whole on one worker, in its order), with the package of PACKAGE_SCOPED whole."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileOrPackageScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return PACKAGE_SCOPED if nodeid.startswith(PACKAGE_SCOPED) else super()._split_scope(nodeid)

    return FileOrPackageScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test` collects its serial tests from the files whose text says `pytest.mark.serial`: a test marked
    serial any other way would run in neither of its two pytest runs."""
    spelled: dict[str, bool] = {}
    for item in items:
        if item.get_closest_marker("serial") is not None:
            path = str(item.path)
            if path not in spelled:
                spelled[path] = "pytest.mark.serial" in item.path.read_text()
            if not spelled[path]:
                raise pytest.UsageError(f"{item.nodeid} is marked serial without the text `pytest.mark.serial` in "
                                        "its file, where `make test` looks for the serial tests")


def pytest_collection_finish(session: pytest.Session) -> None:
    # After collection this process holds ~800k long-lived objects (torch, transformers, hypothesis, every test
    # module), which each full collection would walk again: ~0.5-0.9 s per gc.collect() on the 2-core machine, and
    # the benchmarks' release() calls it after every engine. Frozen objects are left out of every collection.
    gc.freeze()


@pytest.fixture(scope="session")
def spec_models(tmp_path_factory) -> dict[str, str]:
    """A random Llama target, a one-layer draft model with its vocabulary and a random EAGLE head over it."""
    root = tmp_path_factory.mktemp("spec-models")
    target_config = write_tiny_checkpoint(root / "target", arch="llama", seed=11)
    write_tiny_checkpoint(root / "draft", arch="llama", seed=12, num_hidden_layers=1)
    write_eagle_head(root / "head", target_config, seed=5)
    return {name: str(root / name) for name in ("target", "draft", "head")}


def _record_proposals(runner) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, its drafts) for each proposal the runner returns, from now on."""
    recorded: list[tuple[list[int], list[int]]] = []
    collect = runner._collect

    def recording(launched):
        out = collect(launched)
        recorded.extend((list(runner.requests[rid].token_ids), d) for rid, d in out.draft_token_ids.items() if d)
        return out

    runner._collect = recording
    return recorded


@pytest.fixture
def record_proposals():
    return _record_proposals
