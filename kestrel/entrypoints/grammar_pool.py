"""The server's grammar compilation, where it cannot block anyone: limits checked first (kestrel.structured.limits),
then a compile in a worker process under the request's deadline, then the serving process's own compile in a
thread of low priority, cached. The engine gets the request with its grammar compiled (AsyncEngine.submit's
`grammar`) and never compiles; a request waiting for its grammar is not in the engine yet, so it holds no batch slot
and no KV block.

Why compile twice: a compile past its deadline must be stoppable and its memory returned, which only a process
gives; and the compiled grammar cannot travel back cheaply (xgrammar's serialized form of a schema of 1,024
properties is 530 MB, and writing and reading it takes longer than the compile). So the worker proves that the
grammar compiles within the deadline, and the serving process, whose compile then takes about as long again,
compiles it in a thread (xgrammar releases the GIL while compiling: the event loop and the engine run on). A
grammar seen before comes from the cache at once.

`processes=0`: the one compile runs in a thread of the serving process, under the same deadline, but a compile past
it runs on to its end (its result is cached).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kestrel.entrypoints.worker_pool import WorkerLostError, WorkerPool, WorkTimeoutError
from kestrel.request import InvalidRequestError
from kestrel.sampling_params import StructuredOutputsParams
from kestrel.structured.compile import (
    GrammarCache,
    GrammarCompileError,
    GrammarSource,
    compile_source,
    start_compile_worker,
    trial_compile,
)
from kestrel.structured.limits import GrammarLimits, check_structured_outputs, check_tool_schemas

# What a compile worker imports (its initializer's module and xgrammar): the fork server imports it once for all.
COMPILE_WORKER_MODULES = ("kestrel.structured.compile", "xgrammar")
_NICENESS = 5  # the serving process's compile threads yield the cores to the event loop and the engine


def _lower_priority() -> None:
    """Linux keeps a nice value per thread: this one's (and the compile threads xgrammar starts from it)."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + _NICENESS))


def _called(tools: list[dict[str, Any]], tool_choice: str, named_tool: str | None) -> list[dict[str, Any]]:
    """The tools a forced call may call: the named one, or all."""
    return [t for t in tools if t["function"]["name"] == named_tool] if tool_choice == "named" else tools


class GrammarCompilePool:
    def __init__(self, tokenizer_info: Any, *, processes: int, timeout_s: float, limits: GrammarLimits,
                 cache_bytes: int, cache_entries: int, max_threads: int = 1, engine_compiles: bool = False) -> None:
        """`tokenizer_info`: the engine's xgrammar TokenizerInfo (GrammarBackend.tokenizer_info): grammars compiled
        here are the engine's. `processes`: compile workers (0: threads only); `timeout_s`: each request's compile
        deadline, the wait for a free worker included; `max_threads`: xgrammar's threads per compile.
        `engine_compiles`: the engine is an engine core in its own process, where a compiled grammar cannot travel;
        `compile` then proves the grammar compiles in time (a worker, or a thread here) and returns its source,
        which the core compiles off its loop."""
        import xgrammar as xgr

        self.engine_compiles = engine_compiles

        self.timeout_s = timeout_s
        self.limits = limits
        self.cache = GrammarCache(cache_bytes, cache_entries)
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._threads = ThreadPoolExecutor(max(1, processes), thread_name_prefix="kestrel-grammar",
                                           initializer=_lower_priority)
        self._workers = (WorkerPool(processes, start_compile_worker, (tokenizer_info.serialize_json(), max_threads),
                                    name="grammar", preload=COMPILE_WORKER_MODULES) if processes else None)

    def start(self) -> GrammarCompilePool:
        if self._workers is not None:
            self._workers.start()
        return self

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.cache.clear()

    @property
    def replaced(self) -> int:
        """Compile workers killed (a deadline passed, or the client went away) and started again."""
        return self._workers.replaced if self._workers is not None else 0

    # ----- the request path ----------------------------------------------------------------------

    def source(self, spec: StructuredOutputsParams, param: str) -> GrammarSource:
        """The grammar of `spec` as the compiler takes it; one beyond the limits is refused (naming `param`)."""
        check_structured_outputs(spec, param, self.limits)
        return GrammarSource.of(spec)

    def check_tools(self, tools: list[dict[str, Any]], tool_choice: str, named_tool: str | None) -> None:
        """Refuse (naming `tools`) the tools of a forced call whose schemas are beyond the limits: before the chat
        template renders them into the prompt."""
        check_tool_schemas(_called(tools, tool_choice, named_tool), self.limits)

    @staticmethod
    def tool_call_source(tools: list[dict[str, Any]], tool_choice: str, named_tool: str | None,
                         fmt: str) -> GrammarSource:
        """The grammar of a forced tool call (its tools checked by `check_tools`), built in the compile worker: a
        tool's schema alone can take seconds to convert."""
        return GrammarSource.tool_call(_called(tools, tool_choice, named_tool), tool_choice, named_tool, fmt)

    async def compile(self, source: GrammarSource, param: str) -> Any:
        """The compiled grammar (an xgrammar CompiledGrammar; its source with `engine_compiles`); a grammar that
        does not compile, or not within the deadline, is an InvalidRequestError naming `param`. Cancelling the
        caller (its client went away) stops a compile in a worker: the worker is killed and replaced."""
        cached = self.cache.get(source)
        if cached is not None:
            return source if self.engine_compiles else cached
        loop = asyncio.get_running_loop()
        try:
            if self._workers is not None:
                size = await self._workers.run(trial_compile, source, timeout=self.timeout_s)
                if self.engine_compiles:
                    self.cache.put(source, source, size)  # proven: a repeat skips the trial
                    return source
                return await asyncio.shield(self._compile_here(source, loop))
            async with asyncio.timeout(self.timeout_s):  # (wait_for would swallow a cancellation that came with it)
                compiled = await asyncio.shield(self._compile_here(source, loop))
            return source if self.engine_compiles else compiled
        except GrammarCompileError as error:
            raise InvalidRequestError(param, str(error)) from None
        except (WorkTimeoutError, TimeoutError):
            raise InvalidRequestError(param, f"the grammar did not compile within {self.timeout_s:g} s, this "
                                      "server's limit (--grammar-compile-timeout); JSON schemas with many optional "
                                      "properties and patterns with long repetitions compile slowly") from None
        except WorkerLostError:
            raise InvalidRequestError(param, "compiling the grammar ended its worker process (out of memory?)"
                                      ) from None

    def _compile_here(self, source: GrammarSource, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
        """Compile in one of the serving process's threads; the result enters the cache even when nobody waits
        for it any more."""
        future: Future[Any] = self._threads.submit(compile_source, self._compiler, source)

        def store(done: asyncio.Future[Any]) -> None:
            if not done.cancelled() and done.exception() is None:
                compiled = done.result()
                self.cache.put(source, compiled, int(compiled.memory_size_bytes))

        wrapped = asyncio.wrap_future(future, loop=loop)
        wrapped.add_done_callback(store)  # on the event loop, the cache's one thread
        return wrapped
