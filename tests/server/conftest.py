"""Live kestrel servers for the OpenAI API tests: uvicorn in a thread on a free loopback port.

`openai_server` runs the tiny random Llama checkpoint. `start_scripted` builds a server whose
model is a `ScriptedRunner`: the real engine core, scheduler, detokenizer and HTTP stack, with
a model that answers a fixed text, so that tool calls and timing-sensitive cases are exact.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from http_client import HTTP

from kestrel.config import EngineConfig
from kestrel.engine.contracts import ModelRunnerOutput, Ready, SchedulerOutput
from kestrel.engine.core import EngineCore
from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.core_client import CoreClient
from kestrel.entrypoints.server import build_app
from kestrel.loader.model_init import write_tiny_checkpoint
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.structured.backend import GrammarBackend

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256
SCRIPTED_BLOCKS = 256


class LiveServer:
    def __init__(self, app: Any, engine: AsyncEngine, api_key: str | None = API_KEY, model: str = MODEL,
                 server_factory: Callable[[uvicorn.Config], uvicorn.Server] = uvicorn.Server,
                 **uvicorn_config: Any) -> None:
        self.app = app
        self.engine = engine
        self.api_key = api_key
        self.model = model
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2,
                                **uvicorn_config)
        self._server = server_factory(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=60, **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "none", max_retries=0,
                                  timeout=60, **kwargs)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self.engine.shutdown()

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by name, summed over labels (one model per server; finish reasons add up)."""
        text = HTTP.get(f"{self.base_url}/metrics", headers=self.headers).text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name_labels, value = line.rsplit(" ", 1)
                name = name_labels.split("{")[0]
                samples[name] = samples.get(name, 0.0) + float(value)
        return samples

    def wait_idle(self, timeout_s: float = 10.0) -> dict[str, float]:
        """Wait until nothing runs or waits and the KV cache is empty; return the last metrics."""
        deadline = time.monotonic() + timeout_s
        while True:
            samples = self.metrics()
            idle = (samples["kestrel:kv_cache_usage_perc"] == 0 and samples["kestrel:num_requests_running"] == 0
                    and samples["kestrel:num_requests_waiting"] == 0)
            if idle or time.monotonic() > deadline:
                return samples
            time.sleep(0.05)


def assert_no_stall(waits: list[float], what: str, *, typical_s: float, worst_s: float) -> None:
    """Latency under load, told apart from scheduling noise: the stalls these tests guard against lasted seconds
    (work on the event loop, one worker held for a minute), while a 2-core CI machine running the clients, the
    server and its workers can delay any single reply by a few hundred milliseconds. So the median must stay
    near an idle server's and no reply may take as long as a stall."""
    ordered = sorted(waits)
    median = ordered[len(ordered) // 2]
    shown = ", ".join(f"{w * 1e3:.0f}" for w in sorted(waits, reverse=True)[:5])
    assert median <= typical_s and ordered[-1] <= worst_s, (
        f"{what}: median {median * 1e3:.0f} ms (bound {typical_s * 1e3:.0f}), worst {ordered[-1] * 1e3:.0f} ms "
        f"(bound {worst_s * 1e3:.0f}); slowest {shown} ms of {len(waits)}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("server-llama-tiny")
    write_tiny_checkpoint(str(path), arch="llama", seed=0)
    return str(path)


@pytest.fixture(scope="session")
def openai_server(tiny_model_dir: str) -> Iterator[LiveServer]:
    """The real-model server runs with async scheduling, so the whole OpenAI suite covers that path (the
    synchronous one is covered by tests/e2e and the scripted servers)."""
    engine = AsyncEngine.from_args(tiny_model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=32,
                                   max_num_batched_tokens=512, device="cpu", dtype="float32",
                                   async_scheduling=True).start()
    server = LiveServer(build_app(engine, MODEL, api_key=API_KEY, max_request_bytes=1 << 20), engine)
    yield server
    server.stop()


def start_core_process_server(model_dir: str, **engine_args: Any) -> LiveServer:
    """A live server whose engine core runs in its own process (`--engine-core-process`), with openai_server's
    settings unless `engine_args` says otherwise."""
    args = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 32, "max_num_batched_tokens": 512, "device": "cpu",
            "dtype": "float32", "async_scheduling": True, **engine_args}
    engine = CoreClient.from_args(model_dir, **args).start()
    return LiveServer(build_app(engine, MODEL, api_key=API_KEY, max_request_bytes=1 << 20), engine)


@pytest.fixture(scope="session")
def core_process_server(tiny_model_dir: str) -> Iterator[LiveServer]:
    """openai_server with the engine core in its own process."""
    server = start_core_process_server(tiny_model_dir)
    yield server
    server.stop()


@contextlib.contextmanager
def serve_process(model_dir: str, *flags: str, own_group: bool = False) -> Iterator[tuple[subprocess.Popen, str]]:
    """`kestrel serve` as its own process (key API_KEY, model name MODEL), ready: (process, base URL). `own_group`:
    in a process group (and session) of its own, as a shell starts a command, so that a test may signal the group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "kestrel.entrypoints.cli", "serve", "--model", model_dir,
                                "--served-model-name", MODEL, "--port", str(port), "--dtype", "float32",
                                "--log-level", "warning", *flags],
                               cwd=REPO, env={**os.environ, "KESTREL_API_KEY": API_KEY}, start_new_session=own_group)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kestrel serve did not become ready (exit code {process.poll()})")
            try:
                if HTTP.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield process, base
    finally:
        if process.poll() is None:
            process.terminate()  # a drain with nothing in flight: quick, and its tokenizer workers end with it
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        process.wait()


# ----- a scripted model ---------------------------------------------------------------------------------

@dataclass
class _Progress:
    num_tokens: int
    num_prompt_tokens: int
    num_computed: int


@dataclass
class ScriptedRunner:
    """A Runner that 'generates' `script` (then eos) for every request, one token per step."""

    tokenizer: Any
    vocab_size: int
    script: str = "Hello!"
    step_delay_s: float = 0.0
    fail_at_step: int | None = None
    steps: int = 0
    # Each sampled step's grammar bitmask as the runner got it ((request ids, int32 rows) or None), oldest first.
    masks: list[tuple[list[str], Any] | None] = field(default_factory=list)
    _progress: dict[str, _Progress] = field(default_factory=dict)
    _executed: ModelRunnerOutput | None = None

    def execute_model(self, out: SchedulerOutput, non_block: bool = False) -> Any:
        output = self._run(out)
        if out.is_empty:  # it only releases requests
            return Ready(output) if non_block else output
        self._executed = output
        return Ready() if non_block else None

    def sample_tokens(self, grammar: Any, non_block: bool = False) -> Any:
        output, self._executed = self._executed, None
        self.masks.append(None if grammar is None else (list(grammar.req_ids), grammar.bitmask.clone()))
        return Ready(output) if non_block else output

    def _run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("scripted model failure")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self._progress.pop(rid, None)
        for new in out.new_requests:
            self._progress[new.req_id] = _Progress(len(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens)
        script = self.tokenizer.encode(self.script, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            progress = self._progress[rid]
            progress.num_computed += out.num_scheduled_tokens[rid]
            if progress.num_computed < progress.num_tokens:
                sampled.append([])  # a prefill chunk that does not reach the end
                continue
            position = progress.num_tokens - progress.num_prompt_tokens
            sampled.append([script[min(position, len(script) - 1)]])
            progress.num_tokens += 1
        return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))


def scripted_engine(model_dir: str, *, max_queued_requests: int | None = None, max_num_seqs: int = 16,
                    request_timeout_s: float | None = None, grammars: bool = False,
                    **runner_args: Any) -> tuple[AsyncEngine, ScriptedRunner]:
    """A started AsyncEngine over the real EngineCore with a ScriptedRunner as its model; `grammars`: with the
    xgrammar backend of structured outputs (the runner records the masks and does not apply them)."""
    # The scripted model computes nothing, so it affords the checkpoint's whole context (tool prompts are long).
    config = EngineConfig.from_kwargs(model_dir, max_model_len=512, max_num_seqs=max_num_seqs,
                                      kv_cache_blocks=SCRIPTED_BLOCKS, device="cpu")
    tokenizer = load_tokenizer(model_dir)
    runner = ScriptedRunner(tokenizer, int(config.model.hf_config["vocab_size"]), **runner_args)
    structured = (GrammarBackend(tokenizer, runner.vocab_size, frozenset({tokenizer.eos_token_id})) if grammars
                  else None)
    core = EngineCore(config, runner, SCRIPTED_BLOCKS, tokenizer, tokenizer.eos_token_id, structured=structured)
    engine = AsyncEngine(core, tokenizer, model_path=model_dir, max_queued_requests=max_queued_requests,
                         request_timeout_s=request_timeout_s).start()
    return engine, runner


def start_scripted(model_dir: str, *, api_key: str | None = API_KEY, public_docs: bool = False,
                   trust_request_chat_template: bool = False, reasoning_parser: str | None = None,
                   tool_call_parser: str | None = None, exclude_tools_when_tool_choice_none: bool = False,
                   **kwargs: Any) -> tuple[LiveServer, ScriptedRunner]:
    engine, runner = scripted_engine(model_dir, **kwargs)
    app = build_app(engine, MODEL, api_key=api_key, public_docs=public_docs,
                    trust_request_chat_template=trust_request_chat_template, reasoning_parser=reasoning_parser,
                    tool_call_parser=tool_call_parser,
                    exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none)
    return LiveServer(app, engine, api_key), runner


@pytest.fixture(scope="module")
def scripted(tiny_model_dir: str) -> Iterator[tuple[LiveServer, ScriptedRunner]]:
    server, runner = start_scripted(tiny_model_dir)
    yield server, runner
    server.stop()


@pytest.fixture
def start_scripted_server(tiny_model_dir: str) -> Iterator[Callable[..., tuple[LiveServer, ScriptedRunner]]]:
    """Start scripted servers with custom settings; they are stopped after the test."""
    started: list[LiveServer] = []

    def start(**kwargs: Any) -> tuple[LiveServer, ScriptedRunner]:
        server, runner = start_scripted(tiny_model_dir, **kwargs)
        started.append(server)
        return server, runner

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def live_server_class() -> type[LiveServer]:
    return LiveServer


@pytest.fixture
def make_scripted_engine(tiny_model_dir: str) -> Iterator[Callable[..., tuple[AsyncEngine, ScriptedRunner]]]:
    """Build scripted AsyncEngines (no HTTP); they are shut down after the test."""
    engines: list[AsyncEngine] = []

    def make(**kwargs: Any) -> tuple[AsyncEngine, ScriptedRunner]:
        engine, runner = scripted_engine(tiny_model_dir, **kwargs)
        engines.append(engine)
        return engine, runner

    yield make
    for engine in engines:
        engine.shutdown()
