"""`kestrel bench host-step --smoke`: the harness drives the engine in every mode (a check, not a measurement)."""

from kestrel.bench import host_step


def test_host_step_smoke(capsys):
    assert host_step.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    for mode in host_step.MODES:
        assert mode in out


def test_host_step_split_smoke(capsys):
    """The split runs an engine core process driven by the server's CoreClient: the bench follows the client's
    step messages, whatever they carry."""
    assert host_step.main(["--smoke", "--split", "--modes", "unconstrained"]) == 0
    out = capsys.readouterr().out
    assert "engine core in its own process" in out and "unconstrained" in out


def test_host_step_serving_gc_smoke():
    """`--serving-gc` sets the collector as `kestrel serve` does (in its own interpreter here: it freezes the heap)
    and the tail columns are printed."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "kestrel.bench.host_step", "--smoke", "--serving-gc", "--modes",
                             "unconstrained"], capture_output=True, text=True, check=True)
    header = next(line for line in result.stdout.splitlines() if line.startswith("mode"))
    assert "step_p99" in header and "step_max" in header


def test_host_step_core_deltas_smoke(capsys):
    """`--core-deltas` drives the core the engine core process builds (token deltas, no text) in this process, in
    every mode; with `--split` it is refused by name."""
    assert host_step.main(["--smoke", "--core-deltas"]) == 0
    out = capsys.readouterr().out
    for mode in host_step.MODES:
        assert mode in out
    assert host_step.main(["--smoke", "--core-deltas", "--split"]) != 0
    assert "--core-deltas" in capsys.readouterr().err
