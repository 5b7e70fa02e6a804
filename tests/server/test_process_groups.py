"""A terminal's Ctrl-C (SIGINT) and a service manager's stop (SIGTERM to the process group) reach every process of
`kestrel serve`'s group. The server drains on them; its engine core process and the workers keep process groups of
their own (`kestrel.fork_server.leave_stop_signals_to_the_server`), so the request in flight still finishes instead
of failing with the core, and no process is left behind."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import psutil
import pytest
from conftest import API_KEY, MODEL, serve_process


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "group-sigterm"])
def test_a_signal_to_the_servers_whole_group_still_drains_the_request_in_flight(tiny_model_dir, sig):
    events: list[str] = []
    started = threading.Event()

    def stream(base: str) -> None:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    with serve_process(tiny_model_dir, "--engine-core-process", own_group=True) as (server, base):
        children = psutil.Process(server.pid).children(recursive=True)
        assert children  # the engine core process, at least
        reader = threading.Thread(target=stream, args=(base,), daemon=True)
        reader.start()
        assert started.wait(60)
        os.killpg(server.pid, sig)
        reader.join(120)
        assert not reader.is_alive()
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert "error" not in last and last["choices"][0]["finish_reason"] == "length"
        assert sum(1 for e in events[:-1] if json.loads(e).get("choices")) >= 300 // 4  # streamed to the end
        assert server.wait(60) == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, alive
