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
