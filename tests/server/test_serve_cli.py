"""`kestrel serve` as a process: the demo script starts it, chats through the openai client and stops it."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_demo_chat_through_kestrel_serve(tiny_model_dir):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "demo_chat.py"), "--model", tiny_model_dir,
                             "--max-tokens", "5"], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "assistant> " in result.stdout
    assert "completion_tokens=5" in result.stdout or "finish_reason=stop" in result.stdout


def test_serve_help_lists_the_server_options():
    result = subprocess.run([sys.executable, "-m", "kestrel.entrypoints.cli", "serve", "--help"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0
    for option in ("--host", "--port", "--api-key", "--served-model-name", "--max-queued-requests", "--model"):
        assert option in result.stdout
