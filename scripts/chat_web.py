"""Serve a trained model: a chat page at / and an OpenAI-compatible API at /v1/chat/completions.

    python -m scripts.chat_web                               # latest SFT model, http://127.0.0.1:8000
    python -m scripts.chat_web -i rl --num-gpus 8            # one replica per GPU, requests queued
    python -m scripts.chat_web --batch-slots 1               # one request at a time per replica
    python -m scripts.chat_web --host 0.0.0.0 --api-key "$NANOCHAT_API_KEY"   # reachable from the network
    python -m scripts.chat_web --allowed-host chat.example.com     # behind a reverse proxy using that name
    python -m scripts.chat_web --cors-origin http://localhost:3000 # let that web app call the API

    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'

It binds 127.0.0.1 unless --host says otherwise; a public bind without --api-key prints a warning.
The API key can also come from $NANOCHAT_API_KEY. Every request is bounded by the limits below.
On a loopback bind it answers only requests addressed to localhost / 127.0.0.1 / ::1 (plus
--allowed-host names), so a web page cannot reach it through DNS rebinding; POST bodies must be
JSON; other web origins may call the API only when listed with --cors-origin. A connection must
send its request's headers within 10 s (slowloris), in at most 32 KiB with the request line (a
JSON 431 past it: a browser's cookies for localhost count), and one address may hold
--max-connections-per-client connections open (this machine's own are not counted);
X-Forwarded-For is believed only from a proxy on this machine (uvicorn's $FORWARDED_ALLOW_IPS
widens that).

Before the model loads it checks every flag, that it can listen on --host/--port, and that -i/-g/-s
name a checkpoint on disk (else: one line naming the flag and what there is). The banner says what
each `auto` chose (device, dtype, decode, graph step) and the URL to open. At --log-level info (the
default) it logs one line per request as the answer ends: status, duration, time to the first token,
finish reasons, tokens (nanochat/serve_lifecycle.py's RequestLog).

Ctrl-C, SIGTERM or SIGHUP (its terminal closed; output then goes to <base dir>/hangup.log) shuts it
down in order (exit code 0): new and queued requests are answered with a 503 `server_shutting_down`
at once, answers in progress get GRACE_S - STOP_EARLY_S seconds to finish, then are stopped and end
with that error (a stream: an error event and [DONE]).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import sys

from nanochat.flags import FlagParser
from nanochat.http_guard import HEADER_TIMEOUT_S
from nanochat.model_choice import SOURCES, check_checkpoint, check_decode_device
from nanochat.serve_lifecycle import GRACE_S, browse_urls, check_port_free, run_server  # tests set chat_web.GRACE_S
from nanochat.server import ServerSettings

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")   # the names a loopback-bound server answers to
# uvicorn's log levels (a name it does not know was a KeyError traceback after the model had loaded)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
LIMITS = ("max_messages", "max_message_chars", "max_total_chars", "max_max_tokens", "max_top_k", "max_n",
          "max_body_bytes", "max_queue")


def parse_args(argv=None) -> argparse.Namespace:
    d = ServerSettings()
    # FlagParser: a bad flag is one line naming it (script_main); it accepts --a_b for every --a-b
    p = FlagParser(prog="python -m scripts.chat_web", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--source", default="sft",
                   help=f"checkpoint phase: {'|'.join(SOURCES)} (default: %(default)s)")
    p.add_argument("-g", "--model-tag", dest="model_tag", default=None,
                   help="model tag, e.g. d20 (default: the phase's only tag, or its deepest d<N>)")
    p.add_argument("-s", "--step", default="latest", help="checkpoint step (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda|mps (default auto: cuda, else mps, else cpu; "
                   "the banner says which)")
    p.add_argument("--dtype", default="auto", help="auto|bf16|fp32 (default auto: bf16 on a bf16-capable GPU, "
                   "else fp32; the banner says which)")
    p.add_argument("--num-gpus", dest="num_gpus", type=int, default=1,
                   help="CUDA replicas, one per GPU (CPU/MPS: always 1; default: %(default)s)")
    p.add_argument("--decode", default="auto", help="auto|eager|compile|static|graphs (auto: CUDA-graph decode on CUDA, eager elsewhere; with "
                   "--batch-slots > 1 the batched steps run as graphs where the engine captures, else as fixed-shape "
                   "static steps: the banner's decode=)")
    p.add_argument("--graph-step", dest="graph_step", default="auto",
                   help="auto|compiled|eager|persistent: what a graphs/static decode step runs (auto: the persistent "
                        "batch-1 Triton kernel where it was measured faster and passes a probe, else compiled)")
    p.add_argument("--quantize", default="none",
                   help="none|int8: int8 weight-only matrices (nanochat/quantize.py): half the bytes a decode step "
                        "reads, for memory-bound GPUs such as the DGX Spark")
    p.add_argument("--batch-slots", dest="batch_slots", type=int, default=8,
                   help="requests decoded together per replica (continuous batching, nanochat/batching.py); "
                        "1 = one request at a time; otherwise at least --max-n (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only; "
                   "0.0.0.0 or '::' = every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--allowed-host", dest="allowed_hosts", action="append", default=[],
                   metavar="NAME", help="also answer requests whose Host header names NAME (repeatable; e.g. a "
                   "reverse proxy's name). A loopback --host answers only localhost/127.0.0.1/::1 otherwise "
                   "(DNS-rebinding guard); a network --host answers any Host unless this flag is given (then "
                   "only the names listed)")
    p.add_argument("--cors-origin", dest="cors_origins", action="append", default=[],
                   metavar="ORIGIN", help="let web pages of ORIGIN (exact, e.g. http://localhost:3000) call "
                   "the API cross-origin (repeatable; default: no cross-origin access)")
    p.add_argument("--api-key", dest="api_key", default=None,   # $NANOCHAT_API_KEY below: --help must not show it
                   help="require 'Authorization: Bearer KEY' on the API, KEY at least 8 printable ASCII "
                        "characters (default: $NANOCHAT_API_KEY, else no key)")
    p.add_argument("--model-name", dest="model_name", default=None,
                   help="the model id reported by the API (default: nanochat-<source>-<tag>)")
    p.add_argument("-t", "--temperature", type=float, default=d.default_temperature,
                   help="temperature of a request that sets none (default: %(default)s)")
    p.add_argument("-k", "--top-k", dest="top_k", type=int, default=d.default_top_k,
                   help="top-k of a request that sets none; 0 = off (default: %(default)s)")
    p.add_argument("-m", "--max-tokens", dest="max_tokens", type=int, default=d.default_max_tokens,
                   help="max_tokens of a request that sets none (default: %(default)s)")
    limits = p.add_argument_group("limits (each violation is a 4xx error)")
    for name in LIMITS:
        limits.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=getattr(d, name),
                            help="(default: %(default)s)")
    limits.add_argument("--max-concurrent-per-client", dest="max_concurrent_per_client",
                        type=int, default=None, help="concurrent requests per client address (default: the "
                        "number of batch slots x replicas, at least 4, so one client can use every slot)")
    limits.add_argument("--max-connections-per-client", dest="max_connections_per_client", type=int, default=None,
                        help="open connections per client address, loopback ones not counted (default: twice "
                        "--max-concurrent-per-client, at least 256); a request's headers must also arrive within "
                        f"{HEADER_TIMEOUT_S:g} s of its connection opening or its previous answer ending")
    limits.add_argument("--max-temperature", dest="max_temperature", type=float,
                        default=d.max_temperature, help="(default: %(default)s)")
    p.add_argument("--log-level", dest="log_level", default="info",
                   help=f"{'|'.join(LOG_LEVELS)}; info logs one line per request (default: %(default)s)")
    args = p.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("NANOCHAT_API_KEY") or None
    return args


def is_loopback(host: str) -> bool:
    """127.x.x.x, ::1 or localhost: only this machine can connect."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The Host names to answer. Loopback bind: the loopback names (+ --allowed-host): a page whose
    DNS name was re-pointed at 127.0.0.1 still sends its own name and is refused. Network bind:
    any (None) unless --allowed-host lists them."""
    if is_loopback(args.host):
        return tuple(dict.fromkeys((*LOCAL_HOSTS, args.host.lower(), *args.allowed_hosts)))
    return tuple(args.allowed_hosts) or None


def settings_from_args(args: argparse.Namespace, model_name: str) -> ServerSettings:
    fields = {k: getattr(args, k) for k in (*LIMITS, "max_concurrent_per_client", "max_connections_per_client",
                                            "max_temperature", "api_key")}
    return ServerSettings(model_name=model_name, default_temperature=args.temperature, default_top_k=args.top_k,
                          default_max_tokens=args.max_tokens, allowed_hosts=allowed_hosts(args),
                          cors_origins=tuple(args.cors_origins), **fields).validate()


def validate(args: argparse.Namespace) -> None:
    from nanochat.flags import check_model_tag

    check_model_tag(args.model_tag)
    if args.step != "latest" and not re.fullmatch("[0-9]+", args.step):   # as chat_cli: was a traceback at loading
        raise ValueError(f"-s/--step: got {args.step!r}; accepted: latest or an integer >= 0")
    if args.source not in SOURCES:
        raise ValueError(f"-i/--source: got {args.source!r}; accepted: {'|'.join(SOURCES)}")
    if len(args.host) > 2 and args.host[0] == "[" and args.host[-1] == "]":
        args.host = args.host[1:-1]   # [::1], the URL form the server prints, is the address ::1
    if not 0 < args.port < 65536:
        raise ValueError(f"--port: got {args.port}; accepted: 1..65535")
    if args.log_level.lower() not in LOG_LEVELS:
        raise ValueError(f"--log-level: got {args.log_level!r}; accepted: {'|'.join(LOG_LEVELS)}")
    if args.num_gpus < 1:
        raise ValueError(f"--num-gpus: got {args.num_gpus}; accepted: an integer >= 1")
    from nanochat.quantize import check_quantize

    check_quantize(args.quantize)
    from nanochat.engine import DECODE_MODES, GRAPH_STEPS

    if args.decode not in DECODE_MODES:
        raise ValueError(f"--decode: got {args.decode!r}; accepted: {'|'.join(DECODE_MODES)}")
    if args.graph_step not in GRAPH_STEPS:
        raise ValueError(f"--graph-step: got {args.graph_step!r}; accepted: {'|'.join(GRAPH_STEPS)}")
    if args.top_k < 0:
        raise ValueError(f"--top-k: got {args.top_k}; accepted: an integer >= 0 (0 = off)")
    if args.batch_slots != 1 and args.batch_slots < max(args.max_n, 2):
        raise ValueError(f"--batch-slots: got {args.batch_slots}; accepted: 1 (no batching) or an integer >= "
                         f"--max-n ({args.max_n}) and >= 2: a request's n samples share one replica's slots")
    settings_from_args(args, args.model_name or "pending")   # the limits, before any model loads
    # a client's "Authorization: Bearer KEY" reaches the server with its ends trimmed (HTTP strips them),
    # and curl and the openai client send ASCII only: a key ending in a newline (a $NANOCHAT_API_KEY read
    # from a file) or holding "é" was refused for every client, a 401 that no retyping could pass
    if args.api_key is not None and not re.fullmatch(r"[!-~]([ -~]*[!-~])?", args.api_key):
        raise ValueError(f"--api-key (or $NANOCHAT_API_KEY): got a key with {_key_problem(args.api_key)}; accepted: "
                         "printable ASCII characters, not starting or ending with a space")


def _key_problem(key: str) -> str:
    """What in an API key no client can send, said without printing the key."""
    if key != key.strip():
        return "a space or line break at its start or end"
    bad = next(c for c in key if not " " <= c <= "~")
    return f"the character {bad!r}"


def load_replicas(args) -> tuple[list, dict]:
    """One Engine per device: cuda:0..num_gpus-1, or a single CPU / MPS replica."""
    import torch

    from nanochat.checkpoint import find_model_tag, load_model
    from nanochat.common import init_runtime
    from nanochat.engine import Engine
    from nanochat.errors import RequestError
    from nanochat.quantize import quantize_model
    from nanochat.server import replica_workers

    rt = init_runtime(args.device, args.dtype)
    check_decode_device(args.decode, args.graph_step, rt.device)   # was a traceback once the model had loaded
    if rt.device_type == "cuda":
        if args.num_gpus > torch.cuda.device_count():   # RequestError: one line (script_main), not a traceback
            raise RequestError(f"--num-gpus: got {args.num_gpus}; this machine has {torch.cuda.device_count()} "
                               "GPU(s)")
        devices = [torch.device(f"cuda:{i}") for i in range(args.num_gpus)]
    else:
        if args.num_gpus != 1:
            print(f"--num-gpus {args.num_gpus} ignored on {rt.device_type}: serving one replica")
        devices = [rt.device]
    args.model_tag = args.model_tag or find_model_tag(args.source)
    workers, meta, step = [], {}, args.step
    for device in devices:
        # compute_dtype: --dtype, as chat_eval / base_eval score the model (the GPT's default, bf16 on
        # CUDA / fp32 elsewhere, overrode an explicit --dtype fp32 on CUDA or bf16 on a CPU)
        model, tokenizer, meta = load_model(args.source, device, model_tag=args.model_tag, step=step,
                                            compute_dtype=rt.dtype)
        # every replica the first one's step: "latest" read again per GPU could name a newer step
        # that a run still training into the tag saved meanwhile (replicas answering differently)
        step = meta.get("step", step)
        # from the float32 weights, before the cast (the int8 scales stay float32 through it): the
        # int8 model chat_eval / base_eval --quantize int8 score; from bf16 copies ~6% of the int8
        # values and the row scales (by up to 0.4%) came out different
        quantize_model(model, args.quantize)
        if rt.dtype != torch.float32:  # serve from compute-dtype weights: half the bytes per decode step
            model = model.to(rt.dtype)
        engine = Engine(model, tokenizer, decode=args.decode, graph_step=args.graph_step)
        replica = replica_workers(engine, str(device), args.batch_slots)
        mode = replica[0].engine.decode_mode
        if mode != "eager" and device.type == "cuda":   # a GPU's first start compiles kernels: minutes of
            # silence otherwise (a CPU's static decode runs the eager model: its warm-up takes a second)
            print(f"warming up the decode step on {device} (decode={mode}; a machine's first start compiles "
                  "kernels, which can take minutes)...", flush=True)
        warm = replica[0].engine.warmup()   # the BatchedEngine's or the Engine's
        workers += replica
        graph_step = f", graph step {engine.graph_step}" if mode in ("static", "graphs") else ""
        batching = f", {args.batch_slots} batch slots" if args.batch_slots > 1 else ", one request at a time"
        weights = "" if args.quantize == "none" else f", {args.quantize} weights"
        print(f"loaded {args.source}/{args.model_tag} step {meta.get('step')} on {device} ({rt.dtype_name}, "
              f"decode={mode}{graph_step}{batching}{weights}, warm-up {warm:.1f} s)")
        if engine.graph_step_note:
            print(f"  {engine.graph_step_note}")
    return workers, meta


def main(argv=None) -> int:
    args = parse_args(argv)
    validate(args)
    settings = settings_from_args(args, args.model_name or "pending")

    from nanochat.chat_api import default_per_client
    from nanochat.server import WorkerPool, create_app

    check_port_free(args.host, args.port)
    # -i / -g / -s against the checkpoints on disk, naming the flag and what there is (as chat_cli)
    check_checkpoint(args.source, args.model_tag, args.step)
    if not is_loopback(args.host):   # after the checks: an --host that cannot be bound is not "reachable"
        auth = "API key required" if args.api_key else "NO API KEY: anyone who can reach it can use it (--api-key)"
        print(f"WARNING: binding {args.host}:{args.port} makes the server reachable from the network; {auth}",
              file=sys.stderr)
    workers, meta = load_replicas(args)
    settings.model_name = args.model_name or f"nanochat-{args.source}-{args.model_tag}"
    app = create_app(WorkerPool(workers), settings)
    replicas = len({id(w.engine) for w in workers})
    per_client = settings.max_concurrent_per_client or default_per_client(len(workers))  # what create_app uses
    urls = browse_urls(args.host, args.port)
    print(f"serving {settings.model_name} on {urls[0]} ({replicas} replica(s), "
          f"{len(workers)} generation slot(s), up to {per_client} concurrent request(s) per client)")
    if len(urls) > 1:   # a wildcard bind: http://0.0.0.0:8000 is no address to open (and not in every browser)
        print(f"  from other machines: {urls[1]}")
    run_server(app, args.host, args.port, args.log_level, grace_s=GRACE_S)
    return 0


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("chat_web", lambda: validate(parse_args(sys.argv[1:])), lambda: main(sys.argv[1:]))
