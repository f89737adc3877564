"""The `specserve` command line: flags -> EngineConfig/ServerConfig, and argument errors."""
from __future__ import annotations

import pytest

from specserve.cli import _server_config_from_args, build_parser, engine_config_from_args
from specserve.engine.config import DEFAULT, SpecConfig


def _engine_config(*flags: str):
    return engine_config_from_args(build_parser().parse_args(["serve", *flags]))


def test_engine_flags():
    config = _engine_config("--model", "/m", "--device", "cpu", "--dtype", "float32",
                            "--max-running-requests", "8", "--max-total-tokens", "4096",
                            "--attention-backend", "torch", "--disable-overlap")
    assert (config.model, config.device, config.dtype) == ("/m", "cpu", "float32")
    assert (config.max_running_requests, config.max_total_tokens) == (8, 4096)
    assert config.attention_backend == "torch" and not config.enable_overlap
    assert config.spec == DEFAULT and _engine_config().max_running_requests == 64
    assert _engine_config("--tp", "2").tp_size == 2 and config.tp_size == 1
    assert (config.cuda_graph, config.cuda_graph_sampled) == (None, True)  # on with CUDA
    graphs = _engine_config("--disable-cuda-graph", "--disable-cuda-graph-sampled")
    assert (graphs.cuda_graph, graphs.cuda_graph_sampled) == (False, False)
    assert (config.grammar_compile_seconds, config.custom_all_reduce) == (10.0, True)
    other = _engine_config("--grammar-compile-seconds", "2.5", "--disable-custom-all-reduce")
    assert (other.grammar_compile_seconds, other.custom_all_reduce) == (2.5, False)
    with pytest.raises(ValueError, match="^grammar_compile_seconds"):
        _engine_config("--grammar-compile-seconds", "0")


def test_speculative_flags():
    assert _engine_config("--no-speculative").spec is None
    assert _engine_config("--speculative-num-steps", "5").spec == SpecConfig(
        num_steps=5, num_draft_tokens=6)
    assert _engine_config("--draft-model", "/d", "--speculative-algorithm", "eagle",
                          "--speculative-eagle-topk", "4", "--speculative-num-steps", "3",
                          "--speculative-num-draft-tokens", "8").spec == SpecConfig(
        algorithm="eagle", draft_model="/d", num_steps=3, topk=4, num_draft_tokens=8)
    with pytest.raises(ValueError, match="spec.num_draft_tokens"):
        _engine_config("--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "99")


def test_server_flags():
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "0",
                                      "--max-queue", "3", "--max-new-tokens-cap", "50",
                                      "--stream-interval", "6"])
    config = _server_config_from_args(args)
    assert (config.host, config.port, config.max_queue, config.max_new_tokens_cap,
            config.stream_interval) == ("0.0.0.0", 0, 3, 50, 6)
    assert config.max_prompt_tokens is None and config.tls_cert is None
    assert _server_config_from_args(build_parser().parse_args(["serve"])).stream_interval == 1


def test_a_bad_flag_value_is_a_usage_error(capsys):
    from specserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--tls-cert", "cert.pem"])
    assert exit_info.value.code == 2
    assert "tls_cert/tls_key" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--model", "/m"], ["--model"]),
    (["--tp", "2"], ["--tp"]),
    (["--no-speculative", "--device", "cpu"], ["--device", "--no-speculative"]),
    (["--speculative-num-steps", "5", "--max-total-tokens", "64"],
     ["--max-total-tokens", "--speculative-num-steps"]),
])
def test_engine_flags_with_server_are_a_usage_error(capsys, flags, named):
    from specserve.cli import main

    with pytest.raises(SystemExit) as exit_info:  # before any connection: nothing listens there
        main(["generate", "--server", "127.0.0.1:1", "--prompt", "hi", *flags])
    assert exit_info.value.code == 2
    assert f"{', '.join(named)}: engine flags" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--tls-root-cert", "ca.pem"], "--tls-root-cert"),
    (["--stop", "\n"], "--stop"),
    (["--stop", "a", "--tls-root-cert", "ca.pem"], "--tls-root-cert, --stop"),
])
def test_server_only_flags_without_server_are_a_usage_error(capsys, flags, named):
    from specserve.cli import main

    with pytest.raises(SystemExit) as exit_info:  # before the (missing) model is loaded
        main(["generate", "--model", "/no/such/model", "--prompt", "hi", *flags])
    assert exit_info.value.code == 2
    assert f"{named}: only with --server" in capsys.readouterr().err
