"""The `specserve` command: `specserve serve ...` and `specserve generate ...`.

    specserve serve --model DIR --port 50051          # the gRPC server
    specserve serve --model DIR --data-parallel 2     # two engine replicas, placed by Ray
    specserve generate --server 127.0.0.1:50051 --prompt "def add(a, b):"
    specserve generate --model DIR --prompt "..."     # offline, in this process
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Optional

from specserve.engine.config import (
    DEFAULT, KV_CACHE_DTYPES, QUANTIZATION_FLAGS, SUFFIX_CORPUS_TOKENS, EngineConfig, SpecConfig)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face-format model folder (default: the bundled demo model)")
    g.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-running-requests", type=int, default=None)
    g.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV-cache slots (default: what --gpu-memory-utilization leaves)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="the fraction of each GPU's total memory the engine may take in all: "
                        "weights, CUDA graphs, activations, and the KV pool in what is left "
                        "(default 0.9; with --gpus-per-rank below 1, each replica's is this "
                        "times its share)")
    g.add_argument("--prefill-interleave-tokens", type=int, default=None, metavar="N",
                   help="decode fairness: while requests decode, at most N prompt tokens are "
                        "computed between two decode steps, in an extend of their own or riding in "
                        "the decode step (--mixed-steps: the cap of its adaptive budget) "
                        "(default 1024; 0: off, prefill first)")
    g.add_argument("--mixed-steps", action="store_true",
                   help="prompt chunks ride in decode steps instead of extend steps of their own "
                        "(each followed by a decode step); off by default until their CUDA graphs "
                        "are measured (docs/benchmarks.md)")
    g.add_argument("--mixed-step-time-ratio", type=float, default=None, metavar="R",
                   help="with --mixed-steps: a step carries the most prompt tokens whose predicted "
                        "time stays within R times the decode step alone's (a cost model fitted "
                        "from the steps' times), at least an eighth of --prefill-interleave-tokens "
                        "(default 1.5; 0: no model, up to --prefill-interleave-tokens)")
    g.add_argument("--step-log", default=None, metavar="PATH",
                   help="write one JSON line per engine step to PATH: its kind, rows, prompt tokens, "
                        "budget and the term that set it, predicted and measured time, graph or eager "
                        "(bench/step_log_report.py reads it; off by default)")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "torch", "triton", "flashinfer"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV-cache storage: auto (the model's dtype) or fp8_e4m3 (half the bytes "
                        "per token; per-layer scales from the checkpoint, else 1.0)")
    g.add_argument("--disable-overlap", action="store_true",
                   help="run the normal scheduler loop instead of the overlap loop")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="run every forward eagerly (no CUDA graphs; a debugging aid)")
    g.add_argument("--disable-cuda-graph-sampled", action="store_true",
                   help="capture graphs for greedy decode steps only: sampled batches "
                        "(temperature, top-k/p, min-p) run eagerly, and capture takes a third "
                        "of the time")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs per engine)")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="with --tp > 1 on GPUs: NCCL for every all-reduce (default: activation rows "
                        "through a one-shot kernel over symmetric memory with the residual add and "
                        "RMSNorm fused, NCCL past 8 MiB)")
    g.add_argument("--quantization", default="auto", choices=QUANTIZATION_FLAGS,
                   help="weight format: auto (default) serves the checkpoint's own "
                        "(its quantization_config: FP8 block-wise, per-channel or per-tensor; "
                        "AWQ or GPTQ INT4); fp8 on a 16-bit checkpoint quantizes it at load "
                        "(per channel); awq, gptq and fp8 must match a quantized checkpoint's own")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization fp8 on a 16-bit checkpoint: the (untied) LM head in "
                        "FP8 too (per vocabulary row)")
    g.add_argument("--disable-prefix-cache", action="store_true",
                   help="prefill every prompt from scratch (no radix prefix cache)")
    g.add_argument("--grammar-compile-seconds", type=float, default=10.0,
                   help="a structured output's grammar must compile within this long, else the "
                        "request is refused naming its field (default 10)")
    s = parser.add_argument_group("speculative decoding (default: on with the demo model pair)")
    s.add_argument("--no-speculative", action="store_true", help="plain decoding")
    s.add_argument("--draft-model", default=None,
                   help="EAGLE draft model folder (nextn: default the --model checkpoint)")
    s.add_argument("--speculative-algorithm", default=None, choices=["eagle", "eagle3", "nextn", "ngram", "suffix"],
                   help="nextn: DeepSeek-V3's multi-token-prediction module as the draft; ngram: "
                        "drafts copied from the request's own prompt and output (no draft model); "
                        "suffix: as ngram, and from recent requests' outputs too (shared by all "
                        "clients: a request's speed and accepted-draft count can tell whether "
                        "recent outputs continued its text)")
    s.add_argument("--speculative-num-steps", type=int, default=None)
    s.add_argument("--speculative-eagle-topk", type=int, default=None)
    s.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="default: num_steps + 1 with topk 1 (chain drafting)")
    s.add_argument("--speculative-adaptive", action="store_true", default=None,
                   help="each step's draft shape (plain decoding included; with topk > 1 a chain or "
                        "the tree at each depth) chosen from the batch size and the measured acceptance")
    s.add_argument("--speculative-ngram-max", type=int, default=None,
                   help="ngram, suffix: the longest suffix looked up (default 4)")
    s.add_argument("--speculative-ngram-min", type=int, default=None,
                   help="ngram, suffix: the shortest suffix a match may have (default 1)")
    s.add_argument("--speculative-suffix-corpus-tokens", type=int, default=None,
                   help=f"suffix: how many tokens of recent outputs are kept on the device to "
                        f"draft from (default {SUFFIX_CORPUS_TOKENS})")


# SpecConfig field -> its flag's dest.
_SPEC_FLAGS = {"algorithm": "speculative_algorithm", "draft_model": "draft_model",
               "num_steps": "speculative_num_steps", "topk": "speculative_eagle_topk",
               "num_draft_tokens": "speculative_num_draft_tokens", "ngram_max": "speculative_ngram_max",
               "ngram_min": "speculative_ngram_min", "suffix_corpus_tokens": "speculative_suffix_corpus_tokens",
               "adaptive": "speculative_adaptive"}


def _add_kv_events_args(parser: argparse.ArgumentParser) -> None:
    """`serve` only: the engine process publishes them (an offline engine has no publisher)."""
    k = parser.add_argument_group("KV-cache events for gateways (vLLM's format; docs/deployment.md)")
    k.add_argument("--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="publish the prefix cache's stored and evicted blocks on a ZeroMQ PUB "
                        "socket: bound for a host of * (tcp://*:5557), else connected to")
    k.add_argument("--kv-events-replay-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="bind a ROUTER socket that replays buffered event batches from a "
                        "sequence number")
    k.add_argument("--kv-events-topic", default=None,
                   help="the topic frame of every message (llm-d: kv@POD_IP@MODEL)")
    k.add_argument("--kv-events-block-size", type=int, default=None, metavar="N",
                   help="tokens per hashed block (default 16)")


def _spec_config_from_args(args: argparse.Namespace):
    given = {name: getattr(args, dest) for name, dest in _SPEC_FLAGS.items()
             if getattr(args, dest) is not None}
    if args.no_speculative:
        if given:  # refused rather than silently dropped
            raise ValueError(f"{_flag_names([_SPEC_FLAGS[name] for name in given])}: have no "
                             f"effect with --no-speculative")
        return None
    if not given:
        return DEFAULT
    flags = set(given)  # the fields a flag set
    if "num_draft_tokens" not in given and given.get("topk", 1) == 1:
        given["num_draft_tokens"] = given.get("num_steps", SpecConfig.num_steps) + 1
    try:
        return SpecConfig(**given)
    except ValueError as e:  # a usage error: name the flag that set the field
        field, _, message = str(e).partition(": ")
        name = field.removeprefix("spec.")
        if name not in flags:
            raise
        raise ValueError(f"{_flag_names([_SPEC_FLAGS[name]])} ({field}): {message}") from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig that the engine flags describe (shared by serve and generate)."""
    optional = {name: getattr(args, name) for name in ("max_running_requests", "max_total_tokens",
                                                        "gpu_memory_utilization",
                                                        "prefill_interleave_tokens",
                                                        "mixed_step_time_ratio", "step_log",
                                                        "kv_events_endpoint",
                                                        "kv_events_replay_endpoint",
                                                        "kv_events_topic", "kv_events_block_size")
                if getattr(args, name, None) is not None}
    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                        attention_backend=args.attention_backend,
                        kv_cache_dtype=args.kv_cache_dtype,
                        enable_overlap=not args.disable_overlap, tp_size=args.tp,
                        mixed_steps=args.mixed_steps,
                        custom_all_reduce=not args.disable_custom_all_reduce,
                        cuda_graph=False if args.disable_cuda_graph else None,
                        cuda_graph_sampled=not args.disable_cuda_graph_sampled,
                        quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
                        enable_prefix_cache=not args.disable_prefix_cache,
                        grammar_compile_seconds=args.grammar_compile_seconds,
                        spec=_spec_config_from_args(args), **optional)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gRPC server")
    _add_engine_args(serve)
    _add_kv_events_args(serve)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=None,
                   help="0 picks a free port (it is logged); default: $SPECSERVE_PORT, else 50051")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics and an HTTP /health (200 or 503) here")
    g.add_argument("--http-port", type=int, default=None,
                   help="serve the OpenAI-compatible HTTP API here (/v1/completions, "
                        "/v1/chat/completions, ...; needs the `http` extra); 0 picks a free port")
    g.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key)")
    g.add_argument("--tls-key", default=None, help="PEM private key (with --tls-cert)")
    g.add_argument("--max-queue", type=int, default=None,
                   help="calls admitted beyond --max-running-requests before RESOURCE_EXHAUSTED")
    g.add_argument("--max-prompt-tokens", type=int, default=None)
    g.add_argument("--max-new-tokens-cap", type=int, default=None)
    g.add_argument("--max-message-bytes", type=int, default=None,
                   help="largest gRPC message and HTTP body accepted (default 16 MiB)")
    g.add_argument("--http-header-timeout", type=float, default=None,
                   help="seconds an HTTP client gets to send a request's headers (default 10)")
    g.add_argument("--http-body-timeout", type=float, default=None,
                   help="seconds an HTTP client gets to send a request's body (default 60)")
    g.add_argument("--http-max-connections", type=int, default=None,
                   help="open HTTP connections at most, more are refused with 503 (default: "
                        "half the process's file-descriptor limit)")
    g.add_argument("--drain-timeout", type=float, default=None,
                   help="seconds in-flight calls get to finish on SIGTERM")
    g.add_argument("--stats-log-interval", type=float, default=None,
                   help="seconds between throughput/queue/KV log lines while busy (default 10)")
    g.add_argument("--no-reflection", action="store_true", help="turn gRPC server reflection off")
    g.add_argument("--engine-heartbeat-timeout", type=float, default=None,
                   help="seconds without a heartbeat before the engine counts as frozen "
                        "(default 4)")
    g.add_argument("--engine-stall-timeout", type=float, default=None,
                   help="seconds the engine may spend in one step before it counts as stuck "
                        "(default 300; 0: never); must exceed the longest legitimate step")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek-r1", "qwen3"],
                   help="chat: put <think>...</think> in reasoning_content (a grammar applies after it)")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="chat: the model's tool-call format (default: from its chat template)")
    g.add_argument("--tokenizer-workers", type=int, default=None, metavar="N",
                   help="processes that prepare requests (chat templates, tokenising), out of "
                        "the server's GIL (default 2; 0: threads of the server process)")
    g.add_argument("--stream-interval", type=int, default=None, metavar="N",
                   help="a stream's chunks after its first carry at least N tokens (its last "
                        "may carry fewer): fewer, larger chunks for more tokens per server core "
                        "under load (default 1: every engine step's tokens at once)")
    g.add_argument("--log-level", default="INFO")
    c = serve.add_argument_group("cluster (Ray; needs the `ray` extra)")
    c.add_argument("--data-parallel", type=int, default=None, metavar="N",
                   help="serve N engine replicas (each --tp GPUs) placed by Ray, one request "
                        "routed to the replica holding its longest cached prefix unless it is "
                        "much busier than the others")
    c.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto, or HOST:6379); default: a local Ray "
                        "started on demand")
    c.add_argument("--tp-placement", default=None, choices=["node", "pack", "spread"],
                   help="where a replica's --tp ranks run: node (default: one node, spawned "
                        "there), pack (one Ray actor per rank, across nodes when one is not "
                        "enough), spread (each rank on a node of its own)")
    c.add_argument("--routing", default=None, choices=["prefix", "round-robin"],
                   help="prefix (default): the replica holding the longest cached prefix unless "
                        "it is much busier; round-robin: each replica in turn")
    c.add_argument("--gpus-per-rank", type=float, default=None,
                   help="GPUs Ray reserves per tp rank (default 1 on GPUs); 0.5 puts two "
                        "replicas of --tp 1 on one GPU, each taking half the memory that "
                        "--gpu-memory-utilization gives an engine")
    c.add_argument("--front-processes", type=int, default=None, metavar="N",
                   help="N front processes serve the gRPC (and HTTP) port together, each with "
                        "its own clients to every replica (default 1); front i serves "
                        "--metrics-port + i")

    generate = commands.add_parser("generate", help="generate once, offline or through a server")
    _add_engine_args(generate)
    g = generate.add_argument_group("generation")
    g.add_argument("--prompt", required=True)
    g.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="send the request to a running server instead of loading the model "
                        "(the engine flags are then an error: the server's engine generates)")
    g.add_argument("--tls-root-cert", default=None, help="with --server: trust this PEM for TLS")
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable; with --server only)")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def _server_config_from_args(args: argparse.Namespace):
    import os

    from specserve.server.config import ServerConfig

    optional = {field: getattr(args, flag) for field, flag in (
        ("metrics_port", "metrics_port"), ("http_port", "http_port"),
        ("tls_cert", "tls_cert"), ("tls_key", "tls_key"),
        ("max_queue", "max_queue"), ("max_prompt_tokens", "max_prompt_tokens"),
        ("max_new_tokens_cap", "max_new_tokens_cap"), ("max_message_bytes", "max_message_bytes"),
        ("drain_timeout_s", "drain_timeout"), ("stats_log_interval_s", "stats_log_interval"),
        ("engine_heartbeat_timeout_s", "engine_heartbeat_timeout"),
        ("engine_stall_timeout_s", "engine_stall_timeout"), ("reasoning_parser", "reasoning_parser"),
        ("tool_call_parser", "tool_call_parser"),
        ("tokenizer_workers", "tokenizer_workers"), ("stream_interval", "stream_interval"),
        ("http_header_timeout_s", "http_header_timeout"), ("http_body_timeout_s", "http_body_timeout"),
        ("http_max_connections", "http_max_connections")) if getattr(args, flag) is not None}
    if optional.get("engine_stall_timeout_s") == 0:
        optional["engine_stall_timeout_s"] = None
    port = args.port
    if port is None:
        # The Docker image sets SPECSERVE_PORT, and its HEALTHCHECK probes that port.
        value = os.environ.get("SPECSERVE_PORT", "50051")
        if not value.isdigit():
            raise ValueError(f"SPECSERVE_PORT: not a port number: {value!r}")
        port = int(value)
    return ServerConfig(host=args.host, port=port, reflection=not args.no_reflection, **optional)


def _cluster_config_from_args(args: argparse.Namespace):
    """The ClusterConfig the cluster flags describe, or None (one engine process, no Ray).
    Raises ValueError naming the flag, also when Ray is not installed."""
    given = [flag for flag in ("data_parallel", "ray_address", "tp_placement", "routing",
                               "gpus_per_rank", "front_processes") if getattr(args, flag) is not None]
    if not given:
        return None
    from specserve.server.cluster.config import ClusterConfig, TPPlacement, require_ray
    from specserve.server.cluster.routing import RoutingConfig, RoutingPolicy

    try:
        require_ray()
    except ImportError as e:
        raise ValueError(f"{_flag_names(given)}: {e}") from None
    return ClusterConfig(data_parallel=1 if args.data_parallel is None else args.data_parallel,
                         ray_address=args.ray_address,
                         tp_placement=TPPlacement(args.tp_placement or "node"),
                         routing=RoutingConfig(policy=RoutingPolicy(args.routing or "prefix")),
                         gpus_per_rank=args.gpus_per_rank,
                         front_processes=1 if args.front_processes is None else args.front_processes)


def _serve(engine_config: EngineConfig, server_config, cluster, log_level: str) -> int:
    from specserve.server.app import run_server

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_server(engine_config, server_config, cluster=cluster)


# `generate` flags that only a server call uses: the offline engine has no channel to secure
# and matches stop token ids, not stop strings.
_SERVER_ONLY_GENERATE_FLAGS = ("tls_root_cert", "stop")


def _flag_names(dests: list[str]) -> str:
    return ", ".join("--" + dest.replace("_", "-") for dest in dests)


def _generate_flag_conflict(args: argparse.Namespace) -> Optional[str]:
    """Why the `generate` flags do not go together, or None. With --server the engine flags
    would be ignored (the server's engine generates), so one that differs from its default is
    refused rather than silently dropped; without --server the server-only flags are."""
    if args.server is None:
        given = [dest for dest in _SERVER_ONLY_GENERATE_FLAGS if getattr(args, dest) is not None]
        return f"{_flag_names(given)}: only with --server" if given else None
    # The engine flags and their defaults, read from a parser that has only them.
    engine_only = argparse.ArgumentParser(add_help=False)
    _add_engine_args(engine_only)
    given = [dest for dest, default in vars(engine_only.parse_args([])).items()
             if getattr(args, dest) != default]
    return (f"{_flag_names(given)}: engine flags have no effect with --server (the server's "
            f"engine is configured by `specserve serve`)" if given else None)


def _sampling_from_args(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in
            ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
            if getattr(args, name) is not None}


def _print_result(result, as_json: bool) -> None:
    if as_json:
        print(json.dumps(dataclasses.asdict(result)))
    else:
        print(result.text)


def _generate_via_server(args: argparse.Namespace) -> int:
    from specserve.clients import Client

    with Client(args.server, tls_root_cert=args.tls_root_cert) as client:
        result = client.generate(args.prompt, stop=args.stop, **_sampling_from_args(args))
    _print_result(result, args.json)
    return 0


def _generate_offline(args: argparse.Namespace) -> int:
    """Load the model in this process and generate (no server involved)."""
    from specserve.engine import Engine, SamplingParams

    engine = Engine(engine_config_from_args(args))
    try:
        [output] = engine.generate(prompts=[args.prompt],
                                   sampling=SamplingParams(**_sampling_from_args(args)))
    finally:
        engine.shutdown()
    _print_result(output, args.json)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    from specserve.clients.errors import SpecserveError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and (conflict := _generate_flag_conflict(args)) is not None:
        parser.error(conflict)
    try:
        if args.command == "serve":
            # Configuration errors (ValueError naming the field) are usage errors.
            configs = (engine_config_from_args(args), _server_config_from_args(args),
                       _cluster_config_from_args(args))
            if configs[2] is not None:  # each replica's kv-events port: the last one's fits
                from specserve.server.cluster.config import replica_engine_config
                from specserve.server.cluster.front_processes import front_server_config

                replica_engine_config(configs[0], configs[2].data_parallel - 1,
                                      configs[2].gpus_per_rank)
                front_server_config(configs[1], configs[2].front_processes - 1)  # metrics ports
        elif args.server is None:
            return _generate_offline(args)
    except ValueError as e:
        parser.error(str(e))
    if args.command == "serve":
        return _serve(*configs, args.log_level)
    try:
        return _generate_via_server(args)
    except SpecserveError as e:
        print(f"specserve: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
