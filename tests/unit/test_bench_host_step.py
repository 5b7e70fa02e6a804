"""`kestrel bench host-step --smoke`: the harness drives the engine in every mode (a check, not a measurement)."""

from kestrel.bench import host_step


def test_host_step_smoke(capsys):
    assert host_step.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    for mode in host_step.MODES:
        assert mode in out
