"""Coalesced streaming: a consumer slower than the engine gets fewer chunks whose concatenation
is exactly the step-by-step stream (text, token ids, logprobs, finish), through the detokenizer
worker's TextSteps, RequestStream (chunks joined as bytes), the OutputReader thread with the
worker's loop and GenerationCore's cancellation (no server process needed)."""
from __future__ import annotations

import asyncio
import contextlib
import pickle
import random
import threading

import pytest
import zmq

from helpers import VOCAB
from specserve.engine.config import EngineConfig, SamplingParams
from specserve.engine.outputs import EngineInfo, FinishError, StepOutput
from specserve.engine.wire import encode_batch
from specserve.proto import engine_ipc_pb2 as ipc
from specserve.proto import generate_pb2 as pb
from specserve.server.config import ServerConfig
from specserve.server.generation import GenerationCore
from specserve.server.ops.metrics import ServerMetrics
from specserve.server.ops.watchdog import EngineWatchdog
from specserve.server.output_router import OutputReader, RequestStream, SequenceFailed
from specserve.server.text.output_stream import (EngineProgress, OutputStream, chunk_piece,
                                                 join_pieces, merge_chunks)
from specserve.server.workers.detokenizer import (DetokenizerLink, TextSteps, TextUpdate,
                                                  serve_detokenizer)
from specserve.server.text.validation import ValidatedRequest

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from specserve.engine.tokenizer import Tokenizer

    return Tokenizer(tiny_model, [2])


def _request(stops=(), min_new_tokens=0, max_new_tokens=64) -> ValidatedRequest:
    return ValidatedRequest(PROMPT, SamplingParams(max_new_tokens=max_new_tokens,
                                                   min_new_tokens=min_new_tokens, logprobs=True),
                            tuple(stops))


def _steps(rid: str, ids: list[int], sizes: list[int], finish: str = "length") -> list[StepOutput]:
    """The engine's outputs for `ids`, cut into steps of the given sizes (speculative steps emit
    several tokens); logprobs tell the tokens apart."""
    steps, start = [], 0
    for size in sizes:
        piece = ids[start:start + size]
        start += size
        last = start >= len(ids)
        steps.append(StepOutput(rid, piece,
                                new_logprobs=[-float(i) for i in range(start - len(piece), start)],
                                finished=last, finish_reason=finish if last else None,
                                prompt_tokens=len(PROMPT), completion_tokens=start))
        if last:
            break
    return steps


def _random_case(rng: random.Random, tokenizer):
    ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
    sizes = [rng.randint(1, 4) for _ in ids]
    text = tokenizer.decode(ids)
    stops = []
    if text and rng.random() < 0.6:  # a stop string that does occur (or two)
        for _ in range(rng.randint(1, 2)):
            a = rng.randrange(len(text))
            stops.append(text[a:a + rng.randint(1, 4)])
    return ids, sizes, stops, rng.randrange(4)


def _concatenation(chunks: list[pb.GenerateChunk]) -> tuple:
    finish = chunks[-1].finish
    return ("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
            [x for c in chunks for x in c.logprobs], finish.SerializeToString())


def _deliver(stream: RequestStream, updates: list[TextUpdate]) -> None:
    for update in updates:
        stream.deliver(update.index, update.piece, EngineProgress(*update.progress), 0.0)


def _worker(tokenizer, rid: str, request: ValidatedRequest, stream_interval: int = 1) -> TextSteps:
    steps = TextSteps(tokenizer, stream_interval)
    steps.open(rid, request, False)
    return steps


def test_coalesced_chunks_concatenate_to_the_step_by_step_stream(tokenizer):
    """Random token streams (byte-level tokens split UTF-8 characters), step sizes, stop strings
    (matched inside coalesced steps) and consumer speeds: the worker's pieces, joined as bytes,
    equal the in-process OutputStream's chunks merged."""
    rng = random.Random(0)
    coalesced_cases = stopped_coalesced = 0
    for case in range(300):
        ids, sizes, stops, min_new = _random_case(rng, tokenizer)
        request = _request(stops, min_new)
        reference = OutputStream(tokenizer, request, report_spec=False)
        expected = [c for c in map(reference.on_output, _steps("r", ids, sizes)) if c is not None]

        stream = RequestStream(1)
        worker = _worker(tokenizer, "r", request)
        got = []

        async def consume():
            for out in _steps("r", ids, sizes):
                _deliver(stream, worker.step([out]))
                if rng.random() < 0.3:  # the consumer keeps up now and then
                    got.extend(c.message() for c in await stream.next_chunks())
                if got and got[-1].HasField("finish"):
                    return
            while not (got and got[-1].HasField("finish")):
                got.extend(c.message() for c in await stream.next_chunks())

        asyncio.run(consume())
        assert _concatenation(got) == _concatenation(expected), (case, ids, sizes, stops)
        assert all(len(c.logprobs) == len(c.token_ids) for c in got)
        assert all(not c.HasField("finish") for c in got[:-1])
        if len(got) == len(expected):  # kept up throughout: exactly the step-by-step chunks
            assert got == expected
        coalesced_cases += len(got) < len(expected)
        stopped_coalesced += len(got) < len(expected) and bool(got[-1].finish.matched_stop_str)
    assert coalesced_cases > 100  # the test did exercise coalescing
    assert stopped_coalesced > 30  # and stop strings matched inside coalesced steps


def test_a_stream_interval_holds_pieces_until_they_carry_n_tokens(tokenizer):
    """--stream-interval N: the worker's first piece goes at the step it did without one (the
    time to first token is not paced); every later piece but the last carries at least N tokens;
    the pieces concatenate to the step-by-step stream (stop strings included) and the last one
    ends it at the same step."""
    rng = random.Random(2)
    held_cases = 0
    for case in range(300):
        ids, sizes, stops, min_new = _random_case(rng, tokenizer)
        interval = rng.randint(2, 8)
        request = _request(stops, min_new)
        unpaced = _worker(tokenizer, "r", request)
        paced = _worker(tokenizer, "r", request, interval)
        every_step, pieces = [], []  # (step, update)
        for step, out in enumerate(_steps("r", ids, sizes)):
            every_step += [(step, u) for u in unpaced.step([out]) if u.piece is not None]
            pieces += [(step, u) for u in paced.step([out]) if u.piece is not None]
        assert pieces[0][0] == every_step[0][0], case  # the first piece at once
        assert pieces[-1][0] == every_step[-1][0], case  # and the last
        assert pieces[0][1].stamps == every_step[0][1].stamps
        assert all(u.piece.num_tokens >= interval for _, u in pieces[1:-1]), (case, interval)
        assert [u.piece.finished for _, u in pieces] == [False] * (len(pieces) - 1) + [True]
        last, last_unpaced = pieces[-1][1], every_step[-1][1]
        assert (last.engine_finished, last.stopped_by_stop_string) == \
            (last_unpaced.engine_finished, last_unpaced.stopped_by_stop_string)
        assert _concatenation([join_pieces(0, [u.piece]).message() for _, u in pieces]) == \
            _concatenation([join_pieces(0, [u.piece]).message() for _, u in every_step]), case
        assert "r" not in paced.requests and "r" not in paced.paced  # nothing left behind
        held_cases += len(pieces) < len(every_step)
    assert held_cases > 100  # pieces were held


def test_a_closed_request_drops_its_held_pieces(tokenizer):
    """Cancelled with pieces held: the worker forgets them, and later outputs are dropped."""
    worker = _worker(tokenizer, "r", _request(max_new_tokens=100), stream_interval=50)
    steps = _steps("r", list(range(10, 40)), [1, 3, 3, 3, 3])
    assert [u.piece.num_tokens for u in worker.step([steps[0]])] == [1]
    assert worker.step([steps[1]]) == [] and worker.step([steps[2]]) == []  # held
    worker.close("r")
    assert worker.paced == {} and worker.requests == {}
    assert worker.step([steps[3]]) == []


def test_the_worker_paces_by_the_interval_its_init_command_gives(tokenizer, tmp_path):
    """The detokenizer worker's loop (as the engine client starts it: "init" with the server's
    stream interval) answers with paced pieces."""
    from specserve.server.workers.detokenizer import COMMANDS, STEP

    link = DetokenizerLink(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    context = zmq.Context()
    to_worker, from_worker = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    to_worker.connect(link.inbox)
    from_worker.bind(link.outbox)
    worker = threading.Thread(target=serve_detokenizer, args=(link,), daemon=True)
    worker.start()
    try:
        commands = [("init", pickle.dumps(tokenizer), 4), ("open", "r", _request(), False)]
        to_worker.send_multipart([COMMANDS, pickle.dumps(commands)])
        for out in _steps("r", list(range(10, 23)), [1] + [2] * 6):
            batch = encode_batch([out])
            to_worker.send_multipart([STEP, ipc.EngineToServer(batch=batch).SerializeToString()])
        sizes = []
        while not sizes or not sizes[-1][1]:
            assert from_worker.poll(30_000)
            updates = pickle.loads(from_worker.recv())
            sizes += [(u.piece.num_tokens, u.piece.finished) for u in updates
                      if isinstance(u, TextUpdate) and u.piece is not None]
        assert sizes == [(1, False), (4, False), (4, False), (4, True)]
    finally:
        to_worker.send_multipart([COMMANDS, pickle.dumps([("stop",)])])
        worker.join(10)
        to_worker.close(linger=0)
        from_worker.close(linger=0)
        context.term()


def test_held_pieces_come_before_an_error(tokenizer):
    """A sequence that fails with pieces held (the engine's "error" finish): its held tokens
    are sent first, then the error, as without an interval."""
    async def run():
        stream = RequestStream(1)
        worker = _worker(tokenizer, "r", _request(max_new_tokens=100), stream_interval=50)
        steps = _steps("r", list(range(10, 40)), [1, 3, 3, 3])
        for out in steps[:3]:
            _deliver(stream, worker.step([out]))
        failed = StepOutput("r", [], finished=True, finish_reason="error",
                            error=FinishError("INTERNAL", "the grammar service died"))
        updates = worker.step([failed])
        assert [(u.piece is not None, u.error is not None) for u in updates] == \
            [(True, False), (False, True)]
        _deliver(stream, updates[:1])
        stream.fail(SequenceFailed(0, updates[1].error))
        [chunk] = await stream.next_chunks()
        assert list(chunk.message().token_ids) == list(range(10, 17))
        with pytest.raises(SequenceFailed):
            await stream.next_chunks()
        assert worker.paced == {} and worker.requests == {}

    asyncio.run(run())


def test_a_failed_sequence_of_a_paced_request_ends_its_others_in_the_same_step(tokenizer):
    """n = 2 with an interval: sequence 0 fails in the step that also brings sequence 1's
    output (the request is closed in the middle of the step); the worker goes on."""
    request = ValidatedRequest(PROMPT, SamplingParams(max_new_tokens=64, n=2), ())
    worker = TextSteps(tokenizer, 4)
    worker.open("r", request, False)
    first = [StepOutput("r", [10], index=i) for i in range(2)]
    assert len(worker.step(first)) == 2
    failed = StepOutput("r", [], index=0, finished=True, finish_reason="error",
                        error=FinishError("INTERNAL", "failed"))
    updates = worker.step([failed, StepOutput("r", [11, 12], index=1)])
    assert updates[0].error is not None and worker.requests == {} and worker.paced == {}
    assert updates[1].error is None and updates[1].piece.num_tokens == 2  # as unpaced


def test_stream_interval_errors_name_the_field():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="stream_interval"):
            ServerConfig(stream_interval=bad)


def test_an_error_comes_after_the_chunks_delivered_before_it(tokenizer):
    async def run():
        stream = RequestStream(1)
        worker = _worker(tokenizer, "r", _request())
        for out in _steps("r", [10, 11, 12, 13], [1, 1, 1, 1])[:2]:
            _deliver(stream, worker.step([out]))
        stream.fail(RuntimeError("engine gone"))
        [chunk] = await stream.next_chunks()
        assert list(chunk.message().token_ids) == [10, 11]
        with pytest.raises(RuntimeError, match="engine gone"):
            await stream.next_chunks()

    asyncio.run(run())


def test_output_reader_and_worker_coalesce_whole_steps_for_a_stream_not_read(tokenizer,
                                                                             tmp_path):
    """The reader thread forwards steps to the worker (its loop, here in a thread) and routes
    its answers; a consumer that reads nothing until the engine is done gets one chunk; outputs
    of an unknown (never opened) request are dropped; the engine's other messages reach the
    loop."""
    rng = random.Random(1)
    ids = [rng.randrange(VOCAB) for _ in range(30)]
    sizes = [1] + [3] * 10
    stops = [tokenizer.decode(ids)[-6:-3]] if len(tokenizer.decode(ids)) > 6 else []

    async def run():
        loop = asyncio.get_running_loop()
        context = zmq.Context()
        pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        pull.bind("inproc://outputs")
        push.connect("inproc://outputs")
        link = DetokenizerLink(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
        to_worker, from_worker = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        to_worker.connect(link.inbox)
        from_worker.bind(link.outbox)
        worker = threading.Thread(target=serve_detokenizer, args=(link,), daemon=True)
        worker.start()
        streams = {rid: RequestStream(1) for rid in ("a", "b")}
        others, done = [], asyncio.Event()

        def on_routed(routed):
            for item in routed:
                if isinstance(item, TextUpdate):
                    streams[item.rid].deliver(item.index, item.piece,
                                              EngineProgress(*item.progress), 0.0)
                    if all(s._pending and s._pending[-1][1].finished for s in streams.values()):
                        done.set()
                else:
                    others.append(item.load.query_id)

        reader = OutputReader(pull, to_worker, from_worker, loop, on_routed)
        reader.command(("init", pickle.dumps(tokenizer), 1))
        for rid in ("a", "b"):
            reader.command(("open", rid, _request(stops if rid == "b" else ()), False))
        reader.start()
        try:
            steps = {rid: _steps(rid, ids, sizes) for rid in ("a", "b", "gone")}
            for i in range(len(steps["a"])):
                batch = encode_batch([steps[rid][i] for rid in ("a", "b", "gone")])
                push.send(ipc.EngineToServer(batch=batch).SerializeToString())
                push.send(ipc.EngineToServer(load=ipc.LoadReport(query_id=i)).SerializeToString())
            await asyncio.wait_for(done.wait(), 60)
            chunks = {rid: await stream.next_chunks() for rid, stream in streams.items()}
        finally:
            reader.command(("stop",))
            reader.stop()
            await asyncio.to_thread(reader.join)
            await asyncio.to_thread(worker.join, 10)
            push.close(linger=0)
            context.term()
        assert others == list(range(len(steps["a"])))
        for rid, [chunk] in chunks.items():
            reference = OutputStream(tokenizer, _request(stops if rid == "b" else ()),
                                     report_spec=False)
            expected = [c for c in map(reference.on_output, _steps(rid, ids, sizes)) if c]
            assert _concatenation([chunk.message()]) == _concatenation(expected)
            assert chunk.finished and chunk.message().HasField("finish")

    asyncio.run(run())


class _FakeEngine:
    """The EngineClient surface GenerationCore uses; outputs are delivered by the test."""

    def __init__(self):
        self.streams: dict[str, RequestStream] = {}
        self.requests: dict[str, ValidatedRequest] = {}
        self.aborted: list[str] = []

    def check_available(self) -> None:
        pass

    def submit(self, rid, request, report_spec) -> RequestStream:
        self.streams[rid] = RequestStream(request.sampling.n)
        self.requests[rid] = request
        return self.streams[rid]

    def abort(self, rid: str, index=None) -> None:
        self.aborted.append(rid)


def test_cancelling_a_coalesced_stream_aborts_the_engine_request(tokenizer):
    """The consumer takes one chunk holding several steps, then leaves: the engine request is
    aborted (its KV freed; the server tests check the KV itself) and the stream released."""
    engine = _FakeEngine()
    # Prepared in a thread (tokenizer_workers=0): the test's prepare is a lambda.
    core = GenerationCore(engine, EngineConfig(device="cpu"), ServerConfig(tokenizer_workers=0),
                          ServerMetrics(EngineWatchdog(4.0, None).report))
    info = EngineInfo("tiny", "LlamaForCausalLM", VOCAB, 256, "float32", "cpu", (2,), None)
    core.on_engine_ready(info, tokenizer)

    async def run():
        chunks = core.generate("rid-1", lambda served: _request(max_new_tokens=100))
        async with contextlib.aclosing(chunks):
            first = asyncio.ensure_future(chunks.__anext__())
            while "rid-1" not in engine.streams:
                await asyncio.sleep(0.01)  # the prepare thread
            stream = engine.streams["rid-1"]
            worker = _worker(tokenizer, "rid-1", engine.requests["rid-1"])
            for out in _steps("rid-1", list(range(10, 40)), [1, 3, 3, 3])[:4]:
                _deliver(stream, worker.step([out]))
            chunk = await first
            assert list(chunk.message().token_ids) == list(range(10, 20))
            assert chunk.num_tokens == 10
            assert core.num_active_streams == 1 and engine.aborted == []
        # The core's inner generator is closed by the loop's async-generator finalizer, a
        # loop iteration or so later.
        await asyncio.wait_for(core.wait_idle(60), 60)
        assert engine.aborted == ["rid-1"]
        assert core.num_active_streams == 0

    asyncio.run(run())
    core.close()


def test_sequences_of_one_request_are_coalesced_apart(tokenizer):
    """n > 1: a slow consumer gets one chunk per sequence, each its own steps in order."""
    async def run():
        request = ValidatedRequest(PROMPT, SamplingParams(max_new_tokens=64, logprobs=True, n=2,
                                                          temperature=1.0), ())
        stream = RequestStream(2)
        worker = _worker(tokenizer, "r", request)
        steps = {i: _steps("r", [20 + i, 30 + i, 40 + i, 50 + i], [1, 1, 2]) for i in (0, 1)}
        for a, b in zip(steps[0], steps[1]):
            b.index = 1
            _deliver(stream, worker.step([a, b]))
        chunks = [c.message() for c in await stream.next_chunks()]
        assert [c.index for c in chunks] == [0, 1]
        assert [list(c.token_ids) for c in chunks] == [[20, 30, 40, 50], [21, 31, 41, 51]]
        assert all(c.HasField("finish") and len(c.logprobs) == 4 for c in chunks)

    asyncio.run(run())


def _top(token_id):
    return pb.TopLogprobs(candidates=[pb.TokenLogprob(token_id=token_id, logprob=-1.0,
                                                      text=str(token_id))])


def _three_chunks():
    first = pb.GenerateChunk(token_ids=[1], text="a\u00e9", logprobs=[-0.1], top_logprobs=[_top(1)],
                             prompt_logprobs=[pb.PromptTokenLogprob(token_id=9, text="p")],
                             index=2)
    second = pb.GenerateChunk(token_ids=[2, 3], text="bc" * 100, logprobs=[-0.2, -0.3],
                              top_logprobs=[_top(2), _top(3)], index=2)
    empty = pb.GenerateChunk(index=2)
    last = pb.GenerateChunk(token_ids=[4], text="d", logprobs=[-0.4], top_logprobs=[_top(4)],
                            index=2, finish=pb.Finish(reason=pb.FINISH_REASON_LENGTH))
    return [first, second, empty, last]


def test_merge_chunks_keeps_every_field():
    first, second, _, last = _three_chunks()
    merged = merge_chunks([first, second, last])
    assert (list(merged.token_ids), merged.text, merged.index) == \
        ([1, 2, 3, 4], "a\u00e9" + "bc" * 100 + "d", 2)
    assert list(merged.logprobs) == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert [t.candidates[0].token_id for t in merged.top_logprobs] == [1, 2, 3, 4]
    assert [p.token_id for p in merged.prompt_logprobs] == [9]
    assert merged.finish.reason == pb.FINISH_REASON_LENGTH
    assert merge_chunks([first]) is first


def test_pieces_joined_as_bytes_are_the_merged_chunk():
    """join_pieces (bytes only, on the loop) == merge_chunks (parsed messages), for every run of
    consecutive chunks, and a single piece is its chunk."""
    chunks = _three_chunks()
    for start in range(len(chunks)):
        for end in range(start + 1, len(chunks) + 1):
            run_ = chunks[start:end]
            pieces = [chunk_piece(pb.GenerateChunk.FromString(c.SerializeToString())) for c in run_]
            joined = join_pieces(2, pieces)
            assert joined.message() == merge_chunks(run_)
            assert joined.num_tokens == sum(len(c.token_ids) for c in run_)
            assert joined.finished == run_[-1].HasField("finish")


def test_failed_sequences_end_their_request_with_the_engines_error(tokenizer):
    """The engine's "error" finish (both sequences of an n = 2 request in one step) becomes
    the update's error, each once, without a chunk; the request is closed in the worker and
    its stream raises SequenceFailed (its code and message) after the chunks delivered before."""
    from specserve.engine.outputs import FinishError
    from specserve.server.output_router import SequenceFailed

    request = ValidatedRequest(PROMPT, SamplingParams(max_new_tokens=8, n=2), ())
    worker = _worker(tokenizer, "r", request)
    error = FinishError("UNAVAILABLE", "structured_output: the grammar service is down")
    first = worker.step([StepOutput("r", [65], index=0), StepOutput("r", [66], index=1)])
    failed = worker.step([StepOutput("r", [], index=i, finished=True, finish_reason="error", error=error)
                          for i in (0, 1)])
    assert [u.error for u in first] == [None, None] and all(u.piece for u in first)
    assert [(u.index, u.piece, u.error) for u in failed] == [(0, None, error), (1, None, error)]
    assert "r" not in worker.requests
    stream = RequestStream(2)
    _deliver(stream, first)
    stream.fail(SequenceFailed(0, error))

    async def read():
        chunks = await stream.next_chunks()
        with pytest.raises(SequenceFailed) as e:
            await stream.next_chunks()
        return chunks, e.value

    chunks, raised = asyncio.run(read())
    assert [c.index for c in chunks] == [0, 1] and raised.error == error and raised.index == 0


@pytest.mark.parametrize("how", ["error", "abort"])
def test_a_failed_sequence_fails_the_call_with_its_code(tokenizer, how):
    """One sequence of an n = 2 call fails (the engine's "error" finish, INVALID_ARGUMENT naming
    the field) or ends "abort" (which no front may show as a finish_reason: INTERNAL): the call
    raises Refused with that code after the chunks before it; the record has the choice's
    "error" and the status, and the engine request is aborted (its other sequence stops)."""
    from specserve.engine.outputs import FinishError
    from specserve.server.generation import RefusalKind, Refused

    engine = _FakeEngine()
    metrics = ServerMetrics(EngineWatchdog(4.0, None).report)
    core = GenerationCore(engine, EngineConfig(device="cpu"), ServerConfig(tokenizer_workers=0), metrics)
    core.on_engine_ready(EngineInfo("tiny", "LlamaForCausalLM", VOCAB, 256, "float32", "cpu", (2,), None),
                         tokenizer)
    error = FinishError("INVALID_ARGUMENT", "structured_output.json_schema: did not compile")
    request = ValidatedRequest(PROMPT, SamplingParams(max_new_tokens=8, n=2), ())

    async def run():
        got = []
        chunks = core.generate("rid-2", lambda served: request)
        async with contextlib.aclosing(chunks):
            first = asyncio.ensure_future(chunks.__anext__())
            while "rid-2" not in engine.streams:
                await asyncio.sleep(0.01)
            stream, worker = engine.streams["rid-2"], _worker(tokenizer, "rid-2", request)
            _deliver(stream, worker.step([StepOutput("rid-2", [65], index=0)]))
            got.append(await first)
            end = StepOutput("rid-2", [], index=1, finished=True, finish_reason=how,
                             error=error if how == "error" else None)
            for update in worker.step([end]):
                if update.error is not None:
                    stream.fail(SequenceFailed(update.index, update.error))
                else:
                    _deliver(stream, [update])
            with pytest.raises(Refused) as e:
                got.append(await chunks.__anext__())
        return got, e.value

    got, refusal = asyncio.run(run())
    assert [c.index for c in got] == [0]
    if how == "error":
        assert (refusal.kind, refusal.message, refusal.field) == (
            RefusalKind.INVALID_ARGUMENT, error.message, "structured_output.json_schema")
    else:
        assert refusal.kind is RefusalKind.INTERNAL and "(abort)" in refusal.message
    assert engine.aborted == ["rid-2"]
    code = refusal.kind.value
    assert metrics.registry.get_sample_value("specserve_requests_total", {"code": code}) == 1
    assert metrics.registry.get_sample_value("specserve_finished_requests_total",
                                             {"finish_reason": "error"}) == 1
    core.close()
