"""The command line: every benchmark suite is reachable, bad engine settings exit with a message, not a trace."""

import pytest

from kestrel.entrypoints import cli


def test_every_bench_suite_is_registered(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    listed = capsys.readouterr().out
    for suite in ("gemm", "attention", "serve", "ppl", "latency", "throughput"):
        assert suite in listed


def test_config_error_is_a_message(capsys, tmp_path):
    assert cli.main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "no such directory" in err and "Traceback" not in err


def test_generate_runs_with_the_engine_flags_left_out(capsys):
    # The bundled model, no engine flag given (each keeps its config default), speculative decoding on.
    assert cli.main(["generate", "--prompt", "import os\nimport sys\nimport os\nimport", "--max-tokens", "4",
                     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']) == 0
    assert "[finish_reason=length, tokens=4]" in capsys.readouterr().out


def test_chat_sends_each_message_as_one_turn(capsys):
    assert cli.main(["chat", "--message", "What does `os.path.join` do?", "--message", "And `os.getcwd`?",
                     "--max-tokens", "24", "--temperature", "0"]) == 0
    replies = [line for line in capsys.readouterr().out.splitlines() if line.startswith("assistant> ")]
    assert len(replies) == 2 and "os.path.join" in replies[0]  # the chat fine-tune names what it explains


def test_chat_takes_a_chat_template_and_refuses_a_bad_one(capsys, tmp_path, monkeypatch):
    """--chat-template (a file or the template itself) renders the conversation; one that is neither is refused
    before the model loads."""
    from kestrel.entrypoints import llm as llm_module

    rendered: list[str | None] = []
    chat = llm_module.LLM.chat

    def recording_chat(self, messages, *args, **kwargs):
        rendered.append(kwargs.get("chat_template"))
        return chat(self, messages, *args, **kwargs)

    monkeypatch.setattr(llm_module.LLM, "chat", recording_chat)
    template = "{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert cli.main(["chat", "--message", "hi", "--max-tokens", "2", "--chat-template", str(path)]) == 0
    assert rendered == [template]
    assert cli.main(["chat", "--message", "hi", "--chat-template", "no-such-file"]) == 2
    assert "invalid chat_template='no-such-file'" in capsys.readouterr().err
