"""Fourth review of inference and the load-test server: the graph step an Engine reports (and
bench_inference labels) is the one that runs; Engine options refuse values they would misread;
load_test's own server drains on SIGTERM as chat_web does and is started where --port says."""

import json
import os
import signal
import threading
import time

import pytest
import torch

from nanochat.engine import Engine
from tests.test_engine import random_model


# ------------------------------------------------------------------ what a static step runs

@pytest.mark.parametrize("decode, requested", [("static", "compiled"), ("static", "auto"), ("eager", "auto"),
                                               ("eager", "compiled"), ("compile", "auto")])
def test_graph_step_names_the_module_a_static_step_runs(decode, requested):
    """Only CUDA graphs run the compiled step (Engine.new_decoder): decode="static" (and a
    BatchedEngine's rows over an eager/compile engine) run the plain model, yet graph_step said
    "compiled" (chat_cli's banner "graph step compiled", bench_inference's rows unlabelled as the
    compiled ones)."""
    model = random_model("cpu")
    engine = Engine(model, None, decode=decode, graph_step=requested, decode_bucket=16)
    decoder = engine.new_decoder(engine.new_cache(2, engine.max_seq_len))
    assert decoder.step_model is model
    assert engine.graph_step == engine.other_step == "eager", engine.graph_step_note
    if requested == "compiled":   # an explicit request that this mode does not honour says so
        assert "plain model" in engine.graph_step_note and "graphs" in engine.graph_step_note
    if decode == "static":
        engine.generate_batch([3, 1, 4], max_tokens=2, temperature=0.0)
        assert engine.decoders[1].step_model is model


def test_bench_inference_runs_a_static_step_once_and_reports_it(capsys, monkeypatch):
    """--decode static --graph-step compiled,eager,auto ran three identical plain-model benchmarks
    on a CPU, two labelled "static" (the label of the compiled step) and one "static/eager".
    Now static runs each distinct step once and every row says which step ran."""
    from scripts import bench_inference as BI

    built = []
    real = BI._bench_mode

    def record(args, model, rt, spec, prompt, mode, fused, graph_step, sampler, rows):
        built.append((mode, graph_step))
        if len(built) == 1:
            real(args, model, rt, spec, prompt, mode, fused, graph_step, sampler, rows)

    monkeypatch.setattr(BI, "_bench_mode", record)
    monkeypatch.setattr(BI, "bench_model_step", lambda *a: 1e-3)   # 100 timed steps: not what this checks
    assert BI.main(["--device", "cpu", "--depth", "1", "--prompt-len", "4", "--decode-tokens", "1",
                    "--batch-sizes", "1", "--vocab-size", "64", "--seq-len", "16", "--decode", "static,eager",
                    "--graph-step", "compiled,eager,auto", "--repeats", "1"]) == 0
    assert built == [("static", "eager"), ("static", "auto"), ("eager", "compiled")]
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    decode = [r for r in rows if r["bench"] in ("decode", "warmup")]
    assert decode and all(r["decode"] == "static" and r["graph_step"] == "eager" for r in decode), decode


# ------------------------------------------------------------------ Engine options

@pytest.mark.parametrize("value", ["off", "on", 0, None])
def test_fused_qkv_must_be_a_bool(value):
    """fused_qkv="off" was truthy: the engine fused q/k/v (and bench rows were labelled fused)."""
    with pytest.raises(ValueError, match=r"^fused_qkv: got .*; accepted: True\|False"):
        Engine(random_model("cpu"), None, fused_qkv=value)


@pytest.mark.parametrize("value", ["bf16", torch.int64, torch.bool])
def test_cache_dtype_must_be_a_floating_torch_dtype(value):
    """cache_dtype="bf16" was a TypeError from torch.zeros at the first request; torch.int64 decoded
    silently from k/v truncated to integers (other tokens than the model's own)."""
    with pytest.raises(ValueError, match=r"^cache_dtype: got .*; accepted: None or a floating-point torch dtype"):
        Engine(random_model("cpu"), None, cache_dtype=value)
    engine = Engine(random_model("cpu"), None, cache_dtype=torch.bfloat16)
    assert engine.new_cache(1, 4).k[0].dtype == torch.bfloat16


# ------------------------------------------------------------------ load_test's own server

def _stream(url, out, name, max_tokens=200):
    import httpx

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.read().decode().split("\n") if r.status_code == 200 else None
            out[name] = r.status_code, [ln[6:] if ln == "data: [DONE]" else json.loads(ln[6:])
                                        for ln in lines or [] if ln.startswith("data: ")], time.monotonic()
    except Exception as e:  # noqa: BLE001 - reported by the assertions
        out[name] = None, e, time.monotonic()


def test_load_test_server_drains_on_sigterm(tiny_corpus, monkeypatch):
    """`load_test --serve` (the server load_test starts) ran plain uvicorn: on SIGTERM (load_test's
    own terminate(), or a Ctrl-C) answers still running were cut when the grace period ended, a
    queued one too, and the process died of the re-raised signal (exit -15). It now serves through
    chat_web's DrainOnSignal: the queued stream gets the server_shutting_down error at once, the
    running one that error and [DONE] after its short grace, and serve() returns 0. Runs serve() in this process's
    main thread (signals are delivered there), with a no-op SIGTERM handler of its own in place so a
    regression fails the assertions instead of killing pytest."""
    import httpx

    import nanochat.gpt as gpt
    import nanochat.server as server
    from nanochat import serve_lifecycle
    from scripts import load_test
    from tests.test_chat_web import free_port, wait_until
    from tests.test_serve_shutdown import assert_shutdown_event

    forward, create_app, stops = gpt.GPT.forward, server.create_app, []
    signalled, steps = threading.Event(), []

    def slow(self, *a, **kw):   # ~30 tokens/s, never a special token, and held after 20 steps until
        time.sleep(0.03)        # the signal: still answering at it however slowly a loaded machine runs
        steps.append(1)
        if len(steps) > 20:
            signalled.wait(timeout=60)
        logits = forward(self, *a, **kw)
        logits[..., stops] = float("-inf")
        return logits

    def create_app_then_slow(pool, *a, **kw):
        # every special token, not just the engine's default stops: the server also ends an answer on
        # <|user_start|>, which the random model sampled in ~3% of 40-token answers (the running one
        # then ended normally before the drain stopped it: a flake, more often on a loaded machine)
        tokenizer = pool.workers[0].tokenizer
        stops.extend(tokenizer.encode_special(name) for name in tokenizer.special_tokens)
        monkeypatch.setattr(gpt.GPT, "forward", slow)
        return create_app(pool, *a, **kw)

    monkeypatch.setattr(server, "create_app", create_app_then_slow)
    monkeypatch.setattr(serve_lifecycle, "GRACE_S", 1.5)   # generations stopped STOP_EARLY_S (1 s) before it ends
    port = free_port()
    url, out, result = f"http://127.0.0.1:{port}", {}, {}
    args = load_test.parse_args(["--serve", "--port", str(port), "--corpus", str(tiny_corpus),
                                 "--batch-slots", "1", "--concurrency", "4"])

    def client():
        def up():
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False
        try:
            if not wait_until(up, timeout=30):
                return
            # the running answer (450 tokens) is held after 20 steps until the signal: a bound by
            # tokens alone ended it before the signal on a loaded 2-core CI machine
            threads = [threading.Thread(target=_stream, args=(url, out, n, m), daemon=True)
                       for n, m in (("running", 450), ("queued", 200))]
            threads[0].start()
            result["busy"] = wait_until(lambda: httpx.get(url + "/health").json()["available"] == 0, 20)
            threads[1].start()
            result["waiting"] = wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 1, 20)
            time.sleep(0.2)
            result["t0"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)   # delivered to the main thread, as a kill would be
            signalled.set()
            for t in threads:
                t.join(timeout=10)
        finally:
            if "t0" not in result:   # the server never came up or never got busy: stop it anyway
                os.kill(os.getpid(), signal.SIGTERM)
            signalled.set()

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: seen.append(sig))
    watcher = threading.Thread(target=client, daemon=True)
    try:
        watcher.start()
        rc = load_test.serve(args)
        watcher.join(timeout=15)
        restored = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert rc == 0 and "t0" in result and result["busy"] and result["waiting"], (rc, result, out)
    assert restored is not None and restored.__name__ == "<lambda>", restored   # serve() put ours back
    assert not seen, "the re-raised SIGTERM reached the handler in place before serve(): not drained"
    status, events, queued_at = out["queued"]   # a stream still waiting for the one slot: the error event at once
    assert status == 200 and assert_shutdown_event(events, stopped=False) == [], events
    status, events, running_at = out["running"]   # answers on for 0.5 s, then stopped with the error event
    assert status == 200 and len(assert_shutdown_event(events, stopped=True)) > 1, events
    assert queued_at - result["t0"] < 0.4 < running_at - result["t0"] < 1.4, (queued_at, running_at, result)


def test_load_test_starts_its_server_on_the_port_asked_for(monkeypatch):
    """--port ("port for the started server") was passed only to the --serve child's own parser:
    start_server always picked a free port, so `--port 8123` served elsewhere. A port in use is
    refused before the server starts (its /health could be another server's: load-tested instead)."""
    import socket
    import subprocess

    from nanochat.errors import RequestError
    from scripts import load_test

    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or "proc")
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        args = load_test.parse_args(["--port", str(port)])
        with pytest.raises(RequestError, match=rf"--port.*127\.0\.0\.1:{port}"):
            load_test.start_server(args)
    assert not started
    proc, url = load_test.start_server(args)   # now free
    assert url == f"http://127.0.0.1:{port}" and started[0][started[0].index("--port") + 1] == str(port)
    proc, url = load_test.start_server(load_test.parse_args([]))   # default: a free one
    assert url != f"http://127.0.0.1:0" and started[1][started[1].index("--port") + 1] == url.rsplit(":", 1)[1]


def test_load_test_refuses_a_model_tag_for_the_random_model():
    """-g d4 without -i sft load-tested the random tiny model, the tag ignored."""
    from scripts import load_test

    with pytest.raises(ValueError, match=r"^-g/--model-tag: .*-i/--source sft\|rl\|mid\|base"):
        load_test.parse_args(["-g", "d4"])
