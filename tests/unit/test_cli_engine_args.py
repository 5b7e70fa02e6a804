"""The CLI's engine flags come from config.ENGINE_ARGS (one config channel): every engine argument of `LLM(...)`
is a flag with vLLM's spelling, a flag left out leaves the config default, and `kestrel serve MODEL` takes the
model as vLLM's positional argument."""

import pytest

from kestrel.config import ENGINE_ARGS, EngineConfig
from kestrel.entrypoints.cli import _engine_kwargs, build_parser, main


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_every_engine_argument_is_a_flag():
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for arg in ENGINE_ARGS:
        assert "--" + arg.name.replace("_", "-") in help_text
    for vllm_flag in ("-tp", "-pp", "-q", "--enable-prefix-caching", "--no-enable-prefix-caching",
                      "--enable-chunked-prefill", "--num-gpu-blocks-override", "--generation-config", "--block-size",
                      "--tokenizer"):
        assert vllm_flag in help_text


def test_flags_left_out_keep_the_config_defaults(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    args = serve_args(tiny_model_dir)
    assert args.model_tag == tiny_model_dir and _engine_kwargs(args) == {}
    assert EngineConfig.from_kwargs(tiny_model_dir, **_engine_kwargs(args)) == EngineConfig.from_kwargs(tiny_model_dir)


def test_vllm_spellings_reach_the_config(tiny_model_dir):
    args = serve_args(tiny_model_dir, "-tp", "1", "--no-enable-prefix-caching", "--num-gpu-blocks-override", "64",
                      "--max-num-seqs", "8", "--no-async-scheduling", "--generation-config", "vllm")
    kwargs = _engine_kwargs(args)
    assert kwargs == {"tensor_parallel_size": 1, "enable_prefix_caching": False, "kv_cache_blocks": 64,
                      "max_num_seqs": 8, "async_scheduling": False, "generation_config": "vllm"}
    config = EngineConfig.from_kwargs(tiny_model_dir, **kwargs)
    assert (config.cache.enable_prefix_caching, config.cache.kv_cache_blocks, config.scheduler.async_scheduling) == (
        False, 64, False)


def test_unsupported_parallelism_and_two_models_are_errors(tiny_model_dir, capsys):
    assert main(["serve", tiny_model_dir, "-tp", "3"]) == 2
    assert "tensor_parallel_size=3" in capsys.readouterr().err
    assert main(["serve", tiny_model_dir, "--model", "/elsewhere"]) == 2
    assert "two models given" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from kestrel.loader.model_init import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("cli-tiny")
    write_tiny_checkpoint(str(path), arch="llama", seed=0)
    return str(path)


def test_the_hub_cache_variables_become_download_dir(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", "/data/hf")
    assert _engine_kwargs(serve_args(tiny_model_dir))["download_dir"] == "/data/hf/hub"
    monkeypatch.setenv("HF_HUB_CACHE", "/cache")
    assert _engine_kwargs(serve_args(tiny_model_dir))["download_dir"] == "/cache"
    assert _engine_kwargs(serve_args(tiny_model_dir, "--download-dir", "/mine"))["download_dir"] == "/mine"


def test_hf_overrides_replace_config_json_keys(tiny_model_dir, capsys):
    args = serve_args(tiny_model_dir, "--hf-overrides", '{"max_position_embeddings": 32}')
    config = EngineConfig.from_kwargs(tiny_model_dir, **_engine_kwargs(args))
    assert config.model.hf_config["max_position_embeddings"] == 32 and config.model.max_model_len == 32
    with pytest.raises(SystemExit):
        serve_args(tiny_model_dir, "--hf-overrides", "[1]")
    assert "expected a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("flags, refused, reason", [
    (["--task", "embed"], "task='embed'", "--runner pooling"),
    (["--enable-lora"], "enable_lora=True", "LoRA"),
    (["--swap-space", "4"], "swap_space=4", "recomputation"),
    (["--compilation-config", '{"level": 3}'], "compilation_config={'level': 3}", "torch.compile"),
])
def test_vllm_only_flags_are_refused_by_name_with_the_reason(tiny_model_dir, capsys, flags, refused, reason):
    assert main(["serve", tiny_model_dir, *flags]) == 2
    err = capsys.readouterr().err
    assert refused in err and reason in err and "unrecognized" not in err


@pytest.mark.parametrize("flags", [["--task", "generate"], ["--swap-space", "0"], ["--enable-prompt-embeds",
                                                                                     "false"]])
def test_vllm_only_flags_at_a_value_that_asks_nothing_are_accepted(tiny_model_dir, flags):
    kwargs = _engine_kwargs(serve_args(tiny_model_dir, *flags))
    assert EngineConfig.from_kwargs(tiny_model_dir, **kwargs) == EngineConfig.from_kwargs(tiny_model_dir)


@pytest.mark.parametrize("flags", [["--guided-decoding-backend", "xgrammar"],
                                   ["--structured-outputs-config", '{"backend": "xgrammar"}'],
                                   ["--dtype", "float"], ["--kv-cache-dtype", "fp8_e4m3"]])
def test_vllm_values_that_name_what_kestrel_does_are_accepted(tiny_model_dir, flags):
    kwargs = _engine_kwargs(serve_args(tiny_model_dir, *flags))
    config = EngineConfig.from_kwargs(tiny_model_dir, **kwargs)
    assert (config.model.dtype, config.cache.kv_cache_dtype) in (("auto", "auto"), ("float32", "auto"),
                                                                 ("auto", "fp8"))


def test_underscore_flags_and_a_yaml_config_file_as_vllm_reads_them(tiny_model_dir, tmp_path, capsys):
    """`--max_model_len` is `--max-model-len`; `--config FILE` holds flags (either spelling), and the command
    line's own flags win over the file's."""
    from kestrel.entrypoints.cli import expand_argv

    assert expand_argv(["serve", "M", "--max_model_len", "64", "--served_model_name=a_b"]) == [
        "serve", "M", "--max-model-len", "64", "--served-model-name=a_b"]
    config = tmp_path / "serve.yaml"
    config.write_text("max_model_len: 96\nenable_prefix_caching: false\nmax-num-seqs: 4\nenable-lora: false\n"
                      "served_model_name: [a, b]\nhf_overrides: {rope_theta: 10000}\nport: 9001\n")
    argv = expand_argv(["serve", tiny_model_dir, "--config", str(config), "--max-num-seqs", "8"])
    args = serve_args(*argv[1:])
    kwargs = _engine_kwargs(args)
    assert kwargs["max_model_len"] == 96 and kwargs["enable_prefix_caching"] is False
    assert kwargs["enable_lora"] is False  # vLLM-only, at the value that asks for nothing: passed as a value
    assert kwargs["max_num_seqs"] == 8  # the command line wins
    assert kwargs["hf_overrides"] == {"rope_theta": 10000}
    assert args.served_model_name == ["a", "b"] and args.port == 9001
    (tmp_path / "list.yaml").write_text("- a\n")
    for bad, words in (("missing.yaml", "No such file"), ("list.yaml", "a mapping")):
        assert main(["serve", tiny_model_dir, "--config", str(tmp_path / bad)]) == 2
        assert words in capsys.readouterr().err
    from kestrel.config import ConfigError

    with pytest.raises(ConfigError, match="after one of them"):
        expand_argv(["--config", str(config)])  # before any command


def test_token_counts_take_vllms_suffixes(tiny_model_dir, capsys):
    """`--max-model-len 1k` is 1000 and `1K` 1024, as vLLM's command line reads them; a count that is no whole
    number of tokens is refused by the flag's name."""
    kwargs = _engine_kwargs(serve_args(tiny_model_dir, "--max-model-len", "1K", "--max-num-batched-tokens", "2.5k"))
    assert kwargs == {"max_model_len": 1024, "max_num_batched_tokens": 2500}
    assert _engine_kwargs(serve_args(tiny_model_dir, "--max-model-len", "512"))["max_model_len"] == 512
    for bad in ("1.5K", "1.0001k", "12x", "k", "1e3"):
        with pytest.raises(SystemExit):
            serve_args(tiny_model_dir, "--max-model-len", bad)
        err = capsys.readouterr().err
        assert "--max-model-len" in err and "32k or 32K" in err


def test_server_flags_checked_and_vllms_api_key_variable(monkeypatch):
    from kestrel.config import ConfigError
    from kestrel.entrypoints.cli import _server_config
    from kestrel.entrypoints.server_config import ServerConfig

    for port in (0, 65536, 99999):
        with pytest.raises(ConfigError, match="from 1 to 65535"):
            ServerConfig(port=port)
    with pytest.raises(ConfigError, match="contradict"):
        ServerConfig(enable_log_requests=True, disable_log_requests=True)
    monkeypatch.delenv("KESTREL_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert _server_config(serve_args()).api_key == ("from-vllm",)
    monkeypatch.setenv("KESTREL_API_KEY", "ours")
    assert _server_config(serve_args()).api_key == ("ours",)
    assert _server_config(serve_args("--api-key", "flag")).api_key == ("flag",)


def test_cors_lists_take_vllms_json_form_and_leave_the_model_alone(tmp_path):
    """vLLM parses --allowed-origins / --allowed-methods / --allowed-headers as one JSON list each; one plain value
    and repeated flags work too, and a model named after them stays the model."""
    from kestrel.entrypoints.cli import _server_config, expand_argv

    args = serve_args("--allowed-origins", '["https://a.example", "https://b.example"]',
                      "--allowed-methods", '["GET", "POST"]', "/models/m")
    config = _server_config(args)
    assert args.model_tag == "/models/m"
    assert config.allowed_origins == ("https://a.example", "https://b.example")
    assert config.allowed_methods == ("GET", "POST") and config.allowed_headers == ("*",)
    repeated = _server_config(serve_args("--allowed-origins", "*", "--allowed-origins", "https://c.example"))
    assert repeated.allowed_origins == ("*", "https://c.example")
    yaml_file = tmp_path / "cors.yaml"
    yaml_file.write_text("allowed_origins: ['https://a.example', 'https://b.example']\n")
    from_yaml = _server_config(serve_args(*expand_argv(["serve", "M", "--config", str(yaml_file)])[1:]))
    assert from_yaml.allowed_origins == ("https://a.example", "https://b.example")
    for bad in ('["a", 1]', '["a"'):
        with pytest.raises(SystemExit):
            serve_args("--allowed-origins", bad)


def test_vllm_server_flags_kestrel_lacks_are_refused_with_what_to_do(capsys):
    from kestrel.entrypoints.server_config import NOT_SUPPORTED_SERVER_FLAGS

    for name, reason in NOT_SUPPORTED_SERVER_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        with pytest.raises(SystemExit):
            serve_args(flag, "x")
        assert f"{flag} is not supported: {reason}" in capsys.readouterr().err


def test_the_access_log_flag_reaches_uvicorn():
    from kestrel.entrypoints.cli import _server_config

    assert _server_config(serve_args("--disable-uvicorn-access-log")).disable_uvicorn_access_log is True
    assert _server_config(serve_args()).disable_uvicorn_access_log is False


def test_a_port_in_use_is_refused_before_the_model_loads():
    import socket

    from kestrel.config import ConfigError
    from kestrel.entrypoints.server import check_port_free

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve on 127.0.0.1:{port}.*--port"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again


def test_vllms_fit_to_memory_max_model_len_is_refused_with_what_to_do(tiny_model_dir):
    from kestrel.config import ConfigError

    with pytest.raises(ConfigError, match="max_model_len=-1.*leave max_model_len out"):
        EngineConfig.from_kwargs(tiny_model_dir, **_engine_kwargs(serve_args("--max-model-len", "-1")))
