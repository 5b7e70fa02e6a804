"""Start `kestrel serve` on a model, send one chat request through the `openai` client, print the answer, stop.

    python scripts/demo_chat.py [--model DIR] [--message "What does `json.dumps` do?"]

Without --model, `kestrel serve` picks its default model.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai

API_KEY = "demo-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(base_url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server was not ready after {timeout_s:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the server's default model)")
    # kestrel-tiny's chat fine-tune answers questions about the stdlib (docs/kestrel-tiny.md, "Chat fine-tune").
    parser.add_argument("--message", default="What does `os.path.join` do?")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the server to start")
    args = parser.parse_args()

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kestrel.entrypoints.cli", "serve", "--port", str(port),
               "--served-model-name", "demo", "--log-level", "warning"]
    if args.model:
        command += ["--model", args.model]
    # The key travels through the environment, as `kestrel serve` reads KESTREL_API_KEY.
    server = subprocess.Popen(command, env={**os.environ, "KESTREL_API_KEY": API_KEY})
    try:
        wait_until_healthy(base_url, server, args.timeout)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
        reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": args.message}],
                                               max_tokens=args.max_tokens, temperature=0.0)
        choice = reply.choices[0]
        print(f"user> {args.message}")
        print(f"assistant> {choice.message.content}")
        print(f"[finish_reason={choice.finish_reason}, prompt_tokens={reply.usage.prompt_tokens}, "
              f"completion_tokens={reply.usage.completion_tokens}]")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
