"""The grammar process (engine/grammar/process.py) and its shared-memory channel
(engine/grammar/channel.py): mixed batches keep the overlap loop and give each request's own
output; the process dying or a request aborting mid-step leave nothing behind; and, on a GPU,
the mapped memory and the spin-wait kernel inside a captured graph."""
from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time

import pytest
import torch

from helpers import make_predictable_pair, random_prompts
from server_harness import wait_until

from specserve.engine import GrammarSpec, SamplingParams, SpecConfig

CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=6)
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                      "name": {"type": "string", "maxLength": 3}},
                     "required": ["a", "name"], "additionalProperties": False})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_predictable_pair(str(tmp_path_factory.mktemp("pair")))


def _spec(head, shape):
    return None if shape is None else SpecConfig(algorithm="eagle", draft_model=head, **shape)


def _mixed_params(n: int, tokens: int = 24) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=tokens, temperature=0.0,
                           grammar=GrammarSpec("json_schema", SCHEMA) if i % 2 else None)
            for i in range(n)]


def _record_processing(monkeypatch, scheduler) -> list:
    """(constrained, batches still in flight) at each processed batch."""
    seen = []
    process = scheduler._process

    def wrapped(batch):
        seen.append((any(r.grammar is not None for r in batch.decision.reqs), len(scheduler.inflight)))
        return process(batch)

    monkeypatch.setattr(scheduler, "_process", wrapped)
    return seen


@pytest.mark.parametrize("shape", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_mixed_batch_under_overlap_equals_each_request_alone(pair, make_engine, monkeypatch, shape):
    """Constrained and unconstrained requests in one batch under the overlap loop: each output
    is the request's own (run alone), and constrained batches are processed only after the next
    batch was launched (the scheduler never waits for a constrained step)."""
    prompts = random_prompts(6, seed=21, max_len=12)
    params = _mixed_params(6)
    # A full batch: the channel's slots and mask rows are sized for exactly this many.
    engine = make_engine(pair[0], spec=_spec(pair[1], shape), enable_overlap=True, max_running_requests=6)
    alone = [engine.generate(prompt_token_ids=[p], sampling=s)[0].token_ids for p, s in zip(prompts, params)]
    seen = _record_processing(monkeypatch, engine.core.scheduler)
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    for o, p in zip(outs, params):
        if p.grammar is not None and o.finish_reason == "stop":
            assert set(json.loads(o.text)) == {"a", "name"}
    constrained = [inflight for c, inflight in seen if c]
    assert len(constrained) > 5
    # Only the batches of the last steps (nothing left to schedule) are processed with nothing
    # in flight; every other one was overlapped with the next launch.
    assert sum(n == 0 for n in constrained) <= 2, seen


def test_overlap_holds_one_batch_in_flight_for_constrained_steps(pair, make_engine):
    """The overlap loop keeps a constrained batch in flight after its step returns."""
    engine = make_engine(pair[0], spec=_spec(pair[1], CHAIN), enable_overlap=True)
    engine.add_request("c", [5, 6, 7], SamplingParams(max_new_tokens=30, temperature=0.0,
                                                      grammar=GrammarSpec("regex", "a{40}")))
    scheduler = engine.core.scheduler
    kept = []
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        kept.append([any(r.grammar is not None for r in b.decision.reqs) for b in scheduler.inflight])
    assert sum(k == [True] for k in kept) > 5
    text = "".join(engine.tokenizer.decode(o.new_token_ids) for o in outputs)
    assert text == "a" * 30


def _run(engine, requests: dict, until=None, errors=None) -> dict:
    """Step until every request finished: rid -> (tokens, finish reason). `until(outs)` is
    called after each step (it may act on the engine); `errors` gets the FinishError of each
    request that ended with one."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got = {rid: [[], None] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.rid][0] += out.new_token_ids
            if out.finished:
                got[out.rid][1] = out.finish_reason
                if errors is not None and out.error is not None:
                    errors[out.rid] = out.error
        if until is not None:
            until(got)
    return {rid: tuple(v) for rid, v in got.items()}


@pytest.mark.parametrize("how,overlap", [("killed", False), ("killed", True), ("stopped", True)])
def test_a_dead_or_silent_grammar_process_fails_constrained_requests_then_restarts(
        pair, make_engine, monkeypatch, how, overlap):
    """The grammar process dies mid-run (SIGKILL), or stays alive but silent (SIGSTOP: the
    device's wait gives up after its limit and says so in the channel; the engine then kills
    it): constrained requests end with an "error" finish, UNAVAILABLE (their KV freed:
    make_engine checks), with what they had so far inside the grammar; the unconstrained ones
    finish as they would alone; the device never hangs. The engine then restarts the process
    (once nothing constrained is in flight): constrained requests succeed again, without an
    engine restart, and its health says so."""
    from specserve.engine.grammar import channel

    monkeypatch.setattr(channel, "CPU_WAIT_LIMIT_SECONDS", 0.5)
    engine = make_engine(pair[0], spec=_spec(pair[1], CHAIN), enable_overlap=overlap)
    service = engine.core.scheduler.grammars
    prompts = random_prompts(4, seed=22, max_len=10)
    free = SamplingParams(max_new_tokens=40, temperature=0.0)
    bound = SamplingParams(max_new_tokens=40, temperature=0.0, grammar=GrammarSpec("regex", "[ab]{60}"))
    alone = {f"u{i}": engine.generate(prompt_token_ids=[prompts[i]], sampling=free)[0].token_ids for i in (0, 2)}
    assert engine.grammar_health() == (False, 0, "starting")   # not started yet
    assert engine.warm_grammar(60) is True
    before = engine.generate(prompt_token_ids=[prompts[1]], sampling=bound)[0]
    assert before.finish_reason == "length" and engine.grammar_health() == (True, 0, "")
    requests = {"u0": (prompts[0], free), "c1": (prompts[1], bound), "u2": (prompts[2], free),
                "c3": (prompts[3], bound)}
    struck = []
    killed = []

    def strike(got):
        if not struck and len(got["c1"][0]) >= 4:
            killed.append(service._proc)
            os.kill(service._proc.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            struck.append(True)

    errors = {}
    got = _run(engine, requests, strike, errors)
    assert struck
    if how == "stopped":
        killed[0].join(10)
        assert killed[0].exitcode == -signal.SIGKILL   # killed by the engine, not left stopped
    assert got["c1"][1] == got["c3"][1] == "error"
    assert errors["c1"].code == errors["c3"].code == "UNAVAILABLE"
    assert "grammar service" in errors["c1"].message
    for rid in ("c1", "c3"):
        assert set(engine.tokenizer.decode(got[rid][0])) <= {"a", "b"}
    assert got["u0"] == (alone["u0"], "length") and got["u2"] == (alone["u2"], "length")
    # Restarted (at most RESTART_INTERVAL_SECONDS after the last start): within seconds a
    # constrained request gives the output it gave before the death.
    deadline = time.monotonic() + 60
    while True:
        late = engine.generate(prompt_token_ids=[prompts[1]], sampling=bound)[0]
        if late.finish_reason != "error":
            break
        assert late.error.code == "UNAVAILABLE" and late.token_ids == []
        assert time.monotonic() < deadline, "the grammar process was not restarted"
        time.sleep(0.2)
    assert (late.token_ids, late.finish_reason) == (before.token_ids, "length")
    assert service._proc is not killed[0] and service._proc.is_alive()
    assert engine.grammar_health() == (True, 1, "")
    assert engine.generate(prompt_token_ids=[prompts[0]], sampling=free)[0].token_ids == alone["u0"]


@pytest.mark.parametrize("shape", [None, TREE], ids=["plain", "tree"])
def test_abort_mid_step_frees_both_sides(pair, make_engine, shape):
    """Aborting a constrained request while its step is in flight frees its KV (make_engine
    checks) and its matcher in the grammar process; the others are unaffected."""
    engine = make_engine(pair[0], spec=_spec(pair[1], shape), enable_overlap=True)
    service = engine.core.scheduler.grammars
    prompts = random_prompts(3, seed=23, max_len=10)
    params = _mixed_params(3, tokens=30)
    params[0] = SamplingParams(max_new_tokens=40, temperature=0.0, grammar=GrammarSpec("regex", "[ab]{60}"))
    expected = {f"r{i}": engine.generate(prompt_token_ids=[prompts[i]], sampling=params[i])[0].token_ids
                for i in (1, 2)}
    aborted = []

    def abort(got):
        if not aborted and len(got["r0"][0]) >= 3:
            assert engine.core.scheduler.inflight  # its step is in flight
            engine.abort("r0")
            aborted.append(True)

    got = _run(engine, {f"r{i}": (prompts[i], params[i]) for i in range(3)}, abort)
    assert aborted and got["r0"][1] == "abort"
    assert {rid: got[rid][0] for rid in expected} == expected
    assert service.stats()["requests"] == 0
    assert not engine.core.scheduler._constrained


def test_a_bad_grammar_fails_by_name_in_the_engine(pair, make_engine, caplog):
    """A grammar the server would refuse, sent to the engine anyway: the grammar process
    reports the failure by field name, that request aborts, the batch goes on."""
    engine = make_engine(pair[0], spec=_spec(pair[1], CHAIN), enable_overlap=True)
    with caplog.at_level("WARNING", logger="specserve.engine"):
        outs = engine.generate(prompt_token_ids=[[5, 6], [7, 8], [9, 10]], sampling=[
            SamplingParams(max_new_tokens=4, grammar=GrammarSpec("json_schema", '{"type": "objectx"}')),
            SamplingParams(max_new_tokens=6, temperature=0.0, grammar=GrammarSpec("regex", "(yes|no)!")),
            SamplingParams(max_new_tokens=4, temperature=0.0)])
    assert [o.finish_reason for o in outs] == ["error", "stop", "length"]
    assert outs[0].error.code == "INVALID_ARGUMENT"
    assert outs[0].error.message.startswith("structured_output.json_schema: ")
    assert "structured_output.json_schema" in caplog.text
    assert engine.core.scheduler.grammars.stats()["requests"] == 0


def _slow_schema(tag: int, properties: int = 10) -> str:
    """Shallow and valid, but xgrammar takes seconds to convert it (its patterns' repetitions
    expand): over a small budget."""
    return json.dumps({"type": "object", "properties": {
        f"p{tag}_{i}": {"type": "string", "pattern": "([a-z]{1,30}-){1,300}"} for i in range(properties)}})


def test_a_grammar_over_its_compile_budget_fails_by_name(pair, make_engine):
    """A grammar still compiling past grammar_compile_seconds fails its request with
    INVALID_ARGUMENT naming the field (KV freed: make_engine checks); the others, constrained
    or not, go on; the process stays up."""
    engine = make_engine(pair[0], spec=None, grammar_compile_seconds=0.2)
    prompts = random_prompts(3, seed=26, max_len=8)
    free = SamplingParams(max_new_tokens=8, temperature=0.0)
    quick = SamplingParams(max_new_tokens=6, temperature=0.0, grammar=GrammarSpec("regex", "(yes|no)!"))
    slow = SamplingParams(max_new_tokens=6, grammar=GrammarSpec("json_schema", _slow_schema(0)))
    errors = {}
    got = _run(engine, {"slow": (prompts[0], slow), "quick": (prompts[1], quick),
                        "free": (prompts[2], free)}, errors=errors)
    assert got["slow"] == ([], "error") and errors["slow"].code == "INVALID_ARGUMENT"
    assert errors["slow"].message.startswith(
        "structured_output.json_schema: did not compile within the 0.2 s budget")
    assert got["quick"][1] == "stop" and engine.tokenizer.decode(got["quick"][0]) in ("yes!", "no!")
    assert got["free"][1] == "length"
    assert not engine.core.scheduler.grammars.dead
    assert engine.core.scheduler.grammars.stats()["requests"] == 0


def test_a_request_that_leaves_cancels_its_queued_compile(pair, make_engine):
    """Two slow grammars hold both compile threads; a third request's grammar waits for one.
    Aborted (its client left), its compile never starts; the other two compile and run."""
    from specserve.engine.grammar.compiler import COMPILE_THREADS

    assert COMPILE_THREADS == 2
    engine = make_engine(pair[0], spec=None)
    service = engine.core.scheduler.grammars
    params = [SamplingParams(max_new_tokens=2, grammar=GrammarSpec("json_schema", _slow_schema(tag, 4)))
              for tag in range(3)]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [5, 6], p)
    engine.step()  # sends the adds (the process starts)
    assert wait_until(lambda: service.stats()["compiles_started"] == 2, 60)
    engine.abort("r2")
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.rid] = out.finish_reason
    assert got == {"r0": "length", "r1": "length", "r2": "abort"}
    assert service.stats() == {"requests": 0, "phase": service.stats()["phase"], "compiles_started": 2}


# --- the channel on its own ------------------------------------------------------------------
def _answer_phases(name: str, layout, phases: int, delay: float) -> None:
    """Another process: answer `phases` phases, each with masks = the phase's first input."""
    from multiprocessing.shared_memory import SharedMemory

    from specserve.engine.grammar.channel import DEVICE_FLAG, HOST_FLAG, HostViews

    shm = SharedMemory(name)
    views = HostViews(shm.buf, layout)
    for seq in range(1, phases + 1):
        while views.header[DEVICE_FLAG] < seq:
            time.sleep(1e-4)
        time.sleep(delay)  # the device must wait for this
        value = int(views.inputs[seq % 2, 0])
        views.masks[:2].fill_(value)
        views.header[HOST_FLAG] = seq
    del views
    shm.close()


def _channel(device: str):
    from multiprocessing.shared_memory import SharedMemory

    from specserve.engine.grammar.channel import ChannelLayout, DeviceChannel, HostViews

    layout = ChannelLayout(rows=4, width=3, slot=8)
    shm = SharedMemory(create=True, size=layout.nbytes)
    views = HostViews(shm.buf, layout)
    views.header[:] = 0
    return shm, layout, views, DeviceChannel.for_device(views, torch.device(device))


def _close(shm, channel) -> None:
    import gc

    channel.close()
    channel.views = None

    gc.collect()
    try:
        shm.close()
    except BufferError:
        pass
    shm.unlink()


def test_cpu_channel_waits_for_each_answer_in_order():
    shm, layout, views, channel = _channel("cpu")
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_answer_phases, args=(shm.name, layout, 6, 0.02))
    proc.start()
    try:
        for seq in range(1, 7):
            channel.signal(torch.tensor([100 + seq, 7]))
            start = time.perf_counter()
            masks = channel.masks(2)
            assert time.perf_counter() - start >= 0.015   # it waited for the answer
            assert masks.tolist() == [[100 + seq] * 3] * 2
    finally:
        proc.join(10)
        del views
        _close(shm, channel)
    assert proc.exitcode == 0


def test_released_channel_passes_every_wait():
    shm, layout, views, channel = _channel("cpu")
    views.release()
    for _ in range(3):
        channel.signal(torch.tensor([1]))
        assert channel.masks(4).tolist() == [[-1] * 3] * 4
    del views
    _close(shm, channel)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_wait_that_gives_up_passes_every_row_all_allowed(monkeypatch, device):
    """No answer (the grammar process alive but silent): the wait gives up and says so, and every
    row comes back all allowed, not the stale rows the shared masks hold (another phase's: a
    constrained row's mask where an unconstrained row sits now, which once made an
    unconstrained request under overlap decode a token it would not alone); later waits do
    not wait again until the service restarts."""
    from specserve.engine.grammar import channel as channel_module

    monkeypatch.setattr(channel_module, "CPU_WAIT_LIMIT_SECONDS", 0.05)
    monkeypatch.setattr(channel_module, "MAX_SPINS", 1000)
    shm, layout, views, channel = _channel(device)
    try:
        views.masks[:4] = 5                        # a stale, restrictive answer
        channel.signal(torch.tensor([1], device=device))
        assert channel.masks(4).tolist() == [[-1] * 3] * 4
        assert views.timed_out
        channel.signal(torch.tensor([2], device=device))
        start = time.perf_counter()
        assert channel.masks(4).tolist() == [[-1] * 3] * 4
        if device == "cpu":
            assert time.perf_counter() - start < 0.04   # no second wait
    finally:
        del views
        _close(shm, channel)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter runs on machines without CUDA")
def test_channel_kernels_in_the_triton_interpreter():
    """The CUDA channel's kernels (channel_kernels.py) on CPU tensors: signal writes slot
    seq % 2 and the flags; wait passes once the host flag reaches the counter, and gives up
    after max_spins reads otherwise, saying so."""
    from specserve.engine.grammar import channel_kernels
    from specserve.engine.grammar.channel import DEVICE_FLAG, HOST_FLAG, TIMED_OUT

    ring = torch.zeros(2 * 8, dtype=torch.int64)
    header = torch.zeros(16, dtype=torch.int64)
    seq = torch.zeros(1, dtype=torch.int64)
    channel_kernels.signal(torch.arange(5) + 10, 5, seq, ring, header, 8, DEVICE_FLAG)
    assert (seq.item(), header[0].item()) == (1, 1) and ring[8:13].tolist() == [10, 11, 12, 13, 14]
    channel_kernels.signal(torch.arange(3) * 2, 3, seq, ring, header, 8, DEVICE_FLAG)
    assert (seq.item(), header[0].item()) == (2, 2) and ring[:3].tolist() == [0, 2, 4]
    channel_kernels.signal(torch.zeros(1, dtype=torch.int64), 0, seq, ring, header, 8, DEVICE_FLAG)  # no data
    assert (seq.item(), header[0].item()) == (3, 3) and ring[8:13].tolist() == [10, 11, 12, 13, 14]
    header[HOST_FLAG] = 3
    channel_kernels.wait(header, seq, 100, HOST_FLAG, TIMED_OUT)
    assert header[TIMED_OUT].item() == 0
    header[HOST_FLAG] = 2
    channel_kernels.wait(header, seq, 100, HOST_FLAG, TIMED_OUT)
    assert header[TIMED_OUT].item() == 1
    # Given up once, a wait no longer spins (2^30 interpreted reads would not end in the test's
    # time): it returns, the word still set.
    channel_kernels.wait(header, seq, 1 << 30, HOST_FLAG, TIMED_OUT)
    assert header[TIMED_OUT].item() == 1


# --- on a GPU ----------------------------------------------------------------------------------
def _read_device_writes(name: str, layout, out) -> None:
    """Another process: wait for the device's flag, report what the device wrote."""
    from multiprocessing.shared_memory import SharedMemory

    from specserve.engine.grammar.channel import DEVICE_FLAG, HostViews

    shm = SharedMemory(name)
    views = HostViews(shm.buf, layout)
    deadline = time.monotonic() + 30
    while views.header[DEVICE_FLAG] < 1 and time.monotonic() < deadline:
        time.sleep(1e-4)
    out.put((int(views.header[DEVICE_FLAG]), views.inputs[1, :5].tolist()))
    del views
    shm.close()


@pytest.mark.gpu
def test_gpu_mapped_view_written_by_the_device_is_read_by_another_process():
    shm, layout, views, channel = _channel("cuda")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_read_device_writes, args=(shm.name, layout, out))
    proc.start()
    try:
        channel.signal(torch.arange(5, device="cuda") * 3)   # phase 1: slot 1
        torch.cuda.synchronize()
        assert out.get(timeout=30) == (1, [0, 3, 6, 9, 12])
    finally:
        proc.join(10)
        del views
        _close(shm, channel)


@pytest.mark.gpu
def test_gpu_spin_wait_in_a_captured_graph_is_released_by_another_process():
    """signal | wait | copy the masks, captured once, replayed with increasing sequence
    numbers: each replay waits for the other process's answer and sees its masks."""
    shm, layout, views, channel = _channel("cuda")
    src = torch.zeros(2, dtype=torch.int64, device="cuda")
    out = torch.zeros((2, 3), dtype=torch.int32, device="cuda")

    def step():
        channel.signal(src)
        out.copy_(channel.masks(2))

    graph = torch.cuda.CUDAGraph()
    with channel.captured():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()                                  # warm-up (Triton compiles), released
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            step()
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_answer_phases, args=(shm.name, layout, 5, 0.05))
    proc.start()
    try:
        for seq in range(1, 6):
            src.fill_(200 + seq)
            start = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            assert time.perf_counter() - start >= 0.04   # the device waited for the answer
            assert out.tolist() == [[200 + seq] * 3] * 2
        assert not views.timed_out
    finally:
        proc.join(10)
        del views, graph
        _close(shm, channel)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_gpu_constrained_equals_plain_decoding(make_engine, shape):
    """The demo pair on CUDA with graphs: constrained (mixed) batches under overlap, chain and
    tree, give plain decoding's tokens; the device waits are in the graphs."""
    prompts = random_prompts(6, seed=24, max_len=12)
    params = _mixed_params(6, tokens=48)
    kwargs = dict(device="cuda", dtype="float32", attention_backend="triton", max_running_requests=8,
                  enable_overlap=True)
    plain = make_engine(None, spec=None, cuda_graph=False, **kwargs).generate(prompt_token_ids=prompts, sampling=params)
    engine = make_engine(None, spec=None if shape is None else SpecConfig(**shape), cuda_graph=True, **kwargs)
    outs = engine.generate(prompt_token_ids=prompts, sampling=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert set(engine.core.worker.constrained_graphs) == {"greedy", "sampled", "filtered"}
    assert not engine.core.scheduler.grammars.views.timed_out


def test_a_matcher_error_fails_only_its_request(pair, make_engine, tmp_path):
    """A committed token the grammar refuses (a mask not applied: an engine bug) fails that
    request in the grammar process, which says so; the scheduler then ends it (KV freed:
    make_engine checks) and the others go on."""
    from specserve.engine.grammar.compiler import GrammarCompiler
    from specserve.engine.grammar.process import _Server
    from specserve.engine.grammar.request_grammar import RequestGrammar

    # The process side: advancing by a refused token marks the request failed and reports it.
    compiler = GrammarCompiler(f"{pair[0]}/tokenizer.json", 320, [2])
    g = RequestGrammar(compiler.compile(GrammarSpec("regex", "a+")), [2], None)
    g.future.result()
    sent = []
    server = _Server.__new__(_Server)
    server.requests = {7: g}
    server.send = sent.append
    server._scratch = torch.empty((1, 10), dtype=torch.int32)
    server._commit([g], {0: [ord("a"), ord("z")]})
    assert g.failed and not g.usable and sent == [("error", 7, g.failed)]
    compiler.close()
    # The engine side: the report ends the request at the next step, mid-run.
    engine = make_engine(pair[0], spec=_spec(pair[1], CHAIN), enable_overlap=True)
    scheduler = engine.core.scheduler
    prompts = random_prompts(2, seed=25, max_len=10)
    bound = SamplingParams(max_new_tokens=30, temperature=0.0, grammar=GrammarSpec("regex", "[ab]{60}"))
    free = SamplingParams(max_new_tokens=30, temperature=0.0)
    alone = engine.generate(prompt_token_ids=[prompts[1]], sampling=free)[0].token_ids
    failed = []

    def fail(got):
        if not failed and len(got["c"][0]) >= 3:
            serial = next(iter(scheduler._constrained))
            scheduler.take_grammar_news([("error", serial, "token 122 is outside the grammar")], False)
            failed.append(True)

    got = _run(engine, {"c": (prompts[0], bound), "u": (prompts[1], free)}, fail)
    assert failed and got["c"][1] == "error" and got["u"] == (alone, "length")
    assert scheduler.grammars.stats()["requests"] == 0
