"""Load test for the chat server: N concurrent streaming chat requests, while /health is polled to
check the server stays responsive. Reports request latency, time to first token and health-check
latency (p50 / p95), as JSON lines and a table; exits 1 if any request or health check failed.

    python -m scripts.load_test                          # starts its own CPU server (random tiny model)
    python -m scripts.load_test -i sft --model-tag d4    # ... serving a checkpoint instead
    python -m scripts.load_test --url http://127.0.0.1:8000 --api-key KEY --requests 200 --concurrency 50

Without --url the server runs in a subprocess (`--serve` mode of this script) so the load
generator and the server do not share an interpreter; its per-client and queue limits are raised
to the concurrency, since every request comes from 127.0.0.1. It stops as chat_web does on Ctrl-C /
SIGTERM (queued requests answered server_shutting_down at once, running ones ended with that error,
exit code 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SOURCES = ("random", "sft", "rl", "mid", "base")


def parse_args(argv=None) -> argparse.Namespace:
    from nanochat.flags import FlagParser, require, require_float, require_int

    p = FlagParser(prog="python -m scripts.load_test", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--api-key", "--api_key", dest="api_key", default=os.environ.get("NANOCHAT_API_KEY") or None)
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int, default=32)
    p.add_argument("--health-interval", "--health_interval", dest="health_interval", type=float, default=0.1,
                   help="seconds between /health checks during the load")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    p.add_argument("-i", "--source", default="random", help="server model when starting one: random|sft|rl|mid|base")
    p.add_argument("-g", "--model-tag", "--model_tag", dest="model_tag", default=None)
    p.add_argument("--corpus", default=None, help="text for the random model's tokenizer (default: the shared "
                                                  "tiny Shakespeare shards)")
    p.add_argument("--batch-slots", "--batch_slots", dest="batch_slots", type=int, default=8,
                   help="the started server's continuous-batching slots (chat_web's default; 1 = one at a time)")
    p.add_argument("--port", type=int, default=0, help="port for the started server (default: a free one)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # internal: run the server only
    args = p.parse_args(argv)
    for name in ("requests", "concurrency", "max_tokens", "batch_slots"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)}; accepted: an integer >= 1")
    if args.source not in SOURCES:
        raise ValueError(f"-i/--source: got {args.source!r}; accepted: {'|'.join(SOURCES)}")
    if args.source == "random" and args.model_tag is not None:   # it served the random model, the tag unread
        raise ValueError(f"-g/--model-tag: got {args.model_tag!r} with the random model; accepted: a tag with "
                         f"-i/--source {'|'.join(SOURCES[1:])}")
    require_float(args.health_interval, "--health-interval", 0.0, low_inclusive=False)
    require_float(args.timeout, "--timeout", 0.0, low_inclusive=False)
    require_int(args.port, "--port", 0)
    require(args.port <= 65535, "--port", args.port, "0 (a free one) .. 65535")
    if args.url is not None:
        require(args.url.startswith(("http://", "https://")), "--url", args.url, "an http:// or https:// URL")
        return args
    # the server this script starts: what it would refuse (the child died before, or every
    # request failed with a 400) is refused here, before the model is built
    from nanochat.chat_api import ServerSettings

    limit = ServerSettings().max_max_tokens
    require(args.max_tokens <= limit, "--max-tokens", args.max_tokens, f"1..{limit} (the started server's limit)")
    if args.api_key is not None and len(args.api_key) < 8:
        raise ValueError("--api-key ($NANOCHAT_API_KEY): got a key shorter than 8 characters; accepted: >= 8 "
                         "characters (the started server's minimum)")
    if args.source == "random":
        corpus_shards(args.corpus)  # the started server's tokenizer text must be there
    return args


def corpus_shards(corpus: str | None) -> list[Path]:
    """The parquet text shards the random model's tokenizer trains on (--corpus, default: the
    shared tiny Shakespeare shards); ValueError naming --corpus when there are none."""
    shared = Path(os.environ.get("NANOCHAT_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    corpus_dir = Path(corpus) if corpus else shared / "pretrain" / "tiny"
    shards = sorted(corpus_dir.glob("*.parquet"))
    if not shards:
        raise ValueError(f"--corpus: no *.parquet files in {corpus_dir}; pass a directory of text shards")
    return shards


# ------------------------------------------------------------------------------------ server side

def random_tiny_engine(corpus: str | None):
    """A depth-2 GPT with random weights and a 512-token BPE trained on a slice of the corpus."""
    import pyarrow.parquet as pq
    import torch

    from nanochat.engine import Engine
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.tokenizer import Tokenizer

    shards = corpus_shards(corpus)
    texts = pq.read_table(shards[0], columns=["text"]).column("text").to_pylist()[:200]
    tokenizer = Tokenizer.train(texts, vocab_size=512)
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=512, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_kv_head=2,
                          n_embd=64, window_pattern="L"))
    model.init_weights()
    return Engine(model.eval(), tokenizer)


def serve(args) -> int:
    """Run the server in this process (what the load test starts as a subprocess) until Ctrl-C /
    SIGTERM, which shut it down in order as they do chat_web's (its DrainOnSignal: queued requests
    get the server_shutting_down error at once, running answers after a short grace, never a cut
    connection) and return 0, not a death by the re-raised signal."""
    from nanochat.serve_lifecycle import run_server
    from nanochat.server import ServerSettings, WorkerPool, create_app, replica_workers

    if args.source == "random":
        engine = random_tiny_engine(args.corpus)
    else:
        from nanochat.checkpoint import load_model
        from nanochat.engine import Engine

        model, tokenizer, _ = load_model(args.source, "cpu", model_tag=args.model_tag)
        engine = Engine(model, tokenizer)
    limit = max(args.concurrency, 4)
    settings = ServerSettings(model_name=f"load-test-{args.source}", api_key=args.api_key,
                              max_concurrent_per_client=limit, max_queue=limit)
    workers = replica_workers(engine, "cpu", args.batch_slots)
    workers[0].engine.warmup()
    app = create_app(WorkerPool(workers), settings)
    run_server(app, "127.0.0.1", args.port)
    return 0


def start_server(args) -> tuple[subprocess.Popen, str]:
    """The --serve child on --port (0: a free one); returns it and its URL."""
    import socket

    from nanochat.serve_lifecycle import check_port_free

    port = args.port
    if port:   # in use: its /health could answer for another server, which would be load-tested
        check_port_free("127.0.0.1", port, flag="--port")
    else:
        with socket.socket() as s:  # pick a free port, then hand it to the child
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "scripts.load_test", "--serve", "--port", str(port), "-i", args.source,
           "--concurrency", str(args.concurrency), "--batch-slots", str(args.batch_slots)]
    cmd += ["--model-tag", args.model_tag] if args.model_tag else []
    cmd += ["--corpus", args.corpus] if args.corpus else []
    env = dict(os.environ)
    env.pop("NANOCHAT_API_KEY", None)
    if args.api_key:
        env["NANOCHAT_API_KEY"] = args.api_key
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=env)
    return proc, f"http://127.0.0.1:{port}"


# ------------------------------------------------------------------------------------ load side

async def wait_healthy(client, url: str, proc, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before becoming healthy")
        try:
            if (await client.get(url + "/health")).status_code == 200:
                return
        except Exception:  # connection refused while it starts
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url}/health not ready after {timeout:.0f} s")


async def one_request(client, url: str, i: int, args) -> dict:
    body = {"messages": [{"role": "user", "content": f"Request {i}: tell me a story."}], "stream": True,
            "max_tokens": args.max_tokens, "temperature": 1.0, "seed": i, "stream_options": {"include_usage": True}}
    t0, ttft, tokens, done, error = time.perf_counter(), None, 0, False, None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=args.timeout) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
            else:
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            error = event["error"]["message"]
                        if ttft is None and any(c["delta"].get("content") for c in event.get("choices", [])):
                            ttft = time.perf_counter() - t0
                        if event.get("usage"):
                            tokens = event["usage"]["completion_tokens"]
                if not done and error is None:
                    error = "stream ended without [DONE]"
    except Exception as e:  # a load test reports failures instead of stopping at the first
        error = f"{type(e).__name__}: {e}"
    return {"latency": time.perf_counter() - t0, "ttft": ttft, "tokens": tokens, "error": error}


async def poll_health(client, url: str, interval: float, stop: asyncio.Event, out: list) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            ok = (await client.get(url + "/health", timeout=10)).status_code == 200
        except Exception:
            ok = False
        out.append((time.perf_counter() - t0, ok))
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile, linear between the two nearest order statistics (numpy's default), so p50 is
    the median. Rounding the rank to one sample made p50 of two latencies the smaller one and, by
    round-half-to-even, the lower or upper middle sample depending on the count."""
    if not values:
        return None
    values = sorted(values)
    rank = q * (len(values) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (rank - lo)


async def server_counters(client, url: str) -> dict | None:
    """The server's /stats request counters (None where /stats is not readable, e.g. another key)."""
    try:
        r = await client.get(url + "/stats", timeout=10)
        return r.json()["requests"] if r.status_code == 200 else None
    except Exception:  # noqa: BLE001 - an optional figure: a server without /stats still gets load-tested
        return None


def counters_delta(before: dict | None, after: dict | None) -> dict | None:
    """What the load added to the server's counters (chat_requests, completed, cancelled, ...)."""
    if before is None or after is None:
        return None
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


async def run_load(args, url: str, proc) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=args.timeout) as client, \
            httpx.AsyncClient(timeout=10) as health_client:
        await wait_healthy(health_client, url, proc)
        counters = await server_counters(client, url)
        stop, health = asyncio.Event(), []
        poller = asyncio.create_task(poll_health(health_client, url, args.health_interval, stop, health))
        gate = asyncio.Semaphore(args.concurrency)

        async def limited(i):
            async with gate:
                return await one_request(client, url, i, args)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
        stop.set()
        await poller
        counters = counters_delta(counters, await server_counters(client, url))
    ok = [r for r in results if r["error"] is None]
    errors = [r["error"] for r in results if r["error"] is not None]
    lat, ttft = [r["latency"] for r in ok], [r["ttft"] for r in ok if r["ttft"] is not None]
    health_ms = [1e3 * t for t, good in health if good]
    return {"bench": "load", "url": url, "requests": args.requests, "concurrency": args.concurrency,
            "batch_slots": args.batch_slots if args.url is None else None,
            "max_tokens": args.max_tokens, "ok": len(ok), "errors": len(errors), "first_errors": errors[:3],
            "wall_s": wall, "tokens": sum(r["tokens"] for r in ok), "tok_per_s": sum(r["tokens"] for r in ok) / wall,
            "latency_p50_s": pct(lat, 0.5), "latency_p95_s": pct(lat, 0.95), "latency_max_s": max(lat, default=None),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
            "health_checks": len(health), "health_failures": sum(1 for _, good in health if not good),
            "health_p50_ms": pct(health_ms, 0.5), "health_p95_ms": pct(health_ms, 0.95),
            "health_max_ms": max(health_ms, default=None), "server_counters": counters}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args)
    proc, url = (None, args.url.rstrip("/")) if args.url else start_server(args)
    try:
        result = asyncio.run(run_load(args, url, proc))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:   # a server stuck in shutdown must not outlive the test
                proc.kill()
                proc.wait()
    print(json.dumps(result), flush=True)
    f = lambda v, scale=1.0: "-" if v is None else f"{v * scale:.1f}"  # noqa: E731
    print(f"\n{result['requests']} streaming requests, concurrency {result['concurrency']}, "
          f"max_tokens {result['max_tokens']}: {result['ok']} ok, {result['errors']} errors, "
          f"{result['wall_s']:.1f} s, {result['tok_per_s']:.0f} tok/s")
    print(f"{'':<22}{'p50':>10}{'p95':>10}{'max':>10}")
    print(f"{'request latency (ms)':<22}{f(result['latency_p50_s'], 1e3):>10}{f(result['latency_p95_s'], 1e3):>10}"
          f"{f(result['latency_max_s'], 1e3):>10}")
    print(f"{'first token (ms)':<22}{f(result['ttft_p50_s'], 1e3):>10}{f(result['ttft_p95_s'], 1e3):>10}{'':>10}")
    print(f"{'/health (ms)':<22}{f(result['health_p50_ms']):>10}{f(result['health_p95_ms']):>10}"
          f"{f(result['health_max_ms']):>10}   ({result['health_checks']} checks, "
          f"{result['health_failures']} failed)")
    counted = result["server_counters"]
    consistent = True
    if counted is not None:
        print(f"server /stats added: {', '.join(f'{k} {v}' for k, v in sorted(counted.items()))}")
        # the server this script started served only this load: its counts must be exactly it
        consistent = args.url is not None or (
            counted.get("chat_requests", 0) == result["requests"] and counted.get("completed", 0) == result["ok"]
            and counted.get("completion_tokens", 0) == result["tokens"])
        if not consistent:
            print("server /stats disagree with what the clients saw", file=sys.stderr)
    return 0 if result["errors"] == 0 and result["health_failures"] == 0 and consistent else 1


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("load_test", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
