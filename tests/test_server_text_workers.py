"""The text worker processes give exactly the in-process results: the tokenizer pool's prepared
requests (text, token-id and chat prompts, their refusals) and Tokenize/Detokenize; a killed
tokenizer worker fails only the calls in it (UNAVAILABLE) and the pool starts again. (The
detokenizer worker's text, stop strings and logprobs: test_server_coalescing.py and
test_server_detokenize_batch.py; its death: test_server_lifecycle.py.)"""
from __future__ import annotations

import asyncio
import functools
import os
import pickle
import random
import signal

import pytest

from helpers import VOCAB, process_exited
from server_harness import wait_until
from specserve.engine.outputs import EngineInfo
from specserve.proto import generate_pb2 as pb
from specserve.server.config import ServerConfig
from specserve.server.errors import InvalidRequest
from specserve.server.fronts.grpc.servicer import _detokenize, _tokenize, _validate
from specserve.server.generation import build_served
from specserve.server.workers.tokenizer_pool import PoolBroken, TokenizerPool


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from specserve.engine.tokenizer import Tokenizer

    return Tokenizer(tiny_model, [2])


def _random_text(rng: random.Random) -> str:
    alphabet = "ab \n\t.é中🙂<>{}" + "".join(map(chr, range(0x20, 0x7f)))
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))


def _requests(rng: random.Random) -> list:
    calls = []
    for _ in range(60):
        sampling = pb.SamplingParams(max_new_tokens=rng.randrange(1, 64),
                                     stop=[_random_text(rng)[:5] or "x"] if rng.random() < 0.3 else [])
        kind = rng.randrange(4)
        if kind == 0:
            request = pb.GenerateRequest(text=_random_text(rng), sampling=sampling)
        elif kind == 1:
            request = pb.GenerateRequest(sampling=sampling)
            request.token_ids.ids.extend(rng.randrange(VOCAB + 2) for _ in range(rng.randrange(5)))
        else:
            request = pb.GenerateRequest(sampling=sampling)
            for role in ("system", "user")[rng.randrange(2):]:
                request.messages.messages.add(role=role, content=_random_text(rng))
        data = request.SerializeToString()
        calls.append(functools.partial(_validate, request=data))
        text = _random_text(rng)
        calls.append(functools.partial(_tokenize, request=pb.TokenizeRequest(text=text)
                                       .SerializeToString()))
        ids = [rng.randrange(VOCAB + 1) for _ in range(rng.randrange(12))]
        calls.append(functools.partial(_detokenize, request=pb.DetokenizeRequest(token_ids=ids)
                                       .SerializeToString()))
    calls.append(functools.partial(_validate, request=b"\xff\xff"))  # not a message
    return calls


def _outcome(fn, served):
    try:
        return fn(served)
    except InvalidRequest as e:
        return ("refused", str(e))


def test_tokenizer_pool_equals_in_process_and_survives_a_killed_worker(tokenizer):
    info = EngineInfo("tiny", "LlamaForCausalLM", VOCAB, 256, "float32", "cpu", (2,), None)
    config = ServerConfig(max_prompt_tokens=48)
    served = build_served(info, tokenizer, config)
    calls = _requests(random.Random(0))

    async def run():
        pool = TokenizerPool(2, functools.partial(build_served, info, pickle.dumps(tokenizer),
                                                  config))
        try:
            async def pooled(fn):
                try:
                    return await pool.run(fn)
                except InvalidRequest as e:
                    return ("refused", str(e))

            got = await asyncio.gather(*(pooled(fn) for fn in calls))
            expected = [_outcome(fn, served) for fn in calls]
            assert got == expected
            assert sum(isinstance(x, tuple) for x in expected) > 5  # refusals were compared
            assert sum(not isinstance(x, tuple) for x in expected) > 100

            pids = await pool.pids()
            assert len(pids) == 2 and os.getpid() not in pids
            os.kill(pids[0], signal.SIGKILL)
            ok = next(i for i, x in enumerate(expected) if not isinstance(x, tuple))
            with pytest.raises(PoolBroken):
                for _ in range(50):  # the pool notices at its next call
                    await pool.run(calls[ok])
                    await asyncio.sleep(0.05)
            assert await pool.run(calls[ok]) == expected[ok]  # a fresh pool
            # The broken pool's other worker ends. When the killed worker held the call queue's
            # lock, only the executor's SIGTERM ends it: a worker that ignored SIGTERM once hung
            # CI's exit here (so the workers leave the process group instead).
            for _ in range(300):
                if process_exited(pids[1]):
                    break
                await asyncio.sleep(0.1)
            assert process_exited(pids[1])
        finally:
            pool.close()

    asyncio.run(run())


_POOL_OWNER = """
import asyncio, time
from specserve.server.workers.tokenizer_pool import TokenizerPool
pool = TokenizerPool(2, dict)
print(" ".join(map(str, asyncio.run(pool.pids()))), flush=True)
time.sleep(120)
"""


def test_tokenizer_workers_end_when_their_server_is_killed():
    """A server killed without a shutdown (SIGKILL, the OOM killer) leaves no tokenizer worker
    behind: the executor's workers block on a call queue whose write end they hold too, so
    they watch their parent instead. (Before: orphans that lived for good.)"""
    import subprocess
    import sys

    owner = subprocess.Popen([sys.executable, "-c", _POOL_OWNER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(not process_exited(p) for p in pids)
    finally:
        owner.kill()
        owner.wait(30)
    assert wait_until(lambda: all(process_exited(p) for p in pids), timeout=30)
