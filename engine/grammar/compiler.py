"""Grammar compilation with xgrammar, in the grammar process (process.py): grammars compile in
threads of their own while the process keeps answering the device (xgrammar releases the GIL
while it parses and compiles; the request waits for its grammar, others do not), and compiled
grammars are cached by (kind, source), least recently used first out.

The compile threads run at a lower CPU priority (nice + COMPILE_NICENESS, per thread on Linux):
a heavy schema takes the grammar process's idle time, not the engine's, so requests without a
grammar keep their pace while it compiles. The process enforces the time budget (process.py);
a compile nobody waits for any more is cancelled if it has not started (`cancel`).

The cost: parsing a JSON schema grows with its nesting (xgrammar's conversion: 0.04 s at 50
levels, 0.3-0.45 s at 100 on the CI machine; the server refuses schemas nested deeper than
server/text/schema_checks.py allows), compiling with the grammar's states and the vocabulary
(a few ms for a JSON schema over an 8k vocabulary; long bounded strings cost more)."""
from __future__ import annotations

import collections
import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from specserve.engine.config import GrammarSpec

# Compiled grammars kept (each holds masks per grammar state: tens of kB to a few MB).
MAX_CACHED_GRAMMARS = 256
COMPILE_THREADS = 2     # grammars compiling at once (a slow one does not hold up the next)
COMPILE_NICENESS = 10   # added to the compile threads' nice value


# xgrammar 0.2.8 writes a length-bounded JSON string's characters as [^"\\\r\n], which lets raw
# control characters (invalid in JSON) through; its unbounded strings exclude \0-\x1f as JSON
# requires. Outputs must parse, so the class is narrowed in the grammar's text (a round trip).
_LOOSE_JSON_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\]'


def _strict_json_strings(grammar):
    import xgrammar as xgr

    text = str(grammar)
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_JSON_CHARS, _JSON_CHARS)) \
        if _LOOSE_JSON_CHARS in text else grammar


def parse_grammar(spec: GrammarSpec) -> Any:
    """The xgrammar Grammar of a spec, without a tokenizer. ValueError naming
    `structured_output.<kind>`."""
    import xgrammar as xgr

    field = f"structured_output.{spec.kind}"
    try:
        if spec.kind == "json_object":  # OpenAI's json_object: any JSON object
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json_schema":
            try:
                json.loads(spec.source)
            except ValueError as e:
                raise ValueError(f"{field}: not valid JSON ({e})") from None
            # One-line JSON with ", " and ": " between items: free whitespace lets a model
            # pad for ever, and the draft predicts the compact form well.
            return _strict_json_strings(xgr.Grammar.from_json_schema(spec.source, any_whitespace=False))
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.source)
        return xgr.Grammar.from_ebnf(spec.source)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError with its parser's message
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        # "[time] file.cc:line: Check failed: ...: reason": keep the reason.
        raise ValueError(f"{field}: {message.rpartition(': ')[2] or message}") from None


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer; `compile` returns at once with a Future."""

    def __init__(self, tokenizer_file: str, vocab_size: int, eos_ids, max_cached: int = MAX_CACHED_GRAMMARS):
        self._tokenizer_file = tokenizer_file
        self._vocab_size = vocab_size
        self._eos_ids = list(eos_ids)
        self._max_cached = max_cached
        self._cache: collections.OrderedDict[GrammarSpec, Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="specserve-grammar",
                                        initializer=_lower_priority)
        self._compiler = None  # built by the first compile (xgrammar import), under _lock
        self._started: dict[GrammarSpec, float] = {}  # compiling now: since (time.monotonic())
        self.num_started = 0   # compilations begun (tests: a cancelled one never begins)

    def compile(self, spec: GrammarSpec) -> Future:
        """Future of the CompiledGrammar (or of the ValueError naming the bad field). Specs that
        differ only in after_token_id share one compilation."""
        key = GrammarSpec(spec.kind, spec.source)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return future

    def forget(self, spec: GrammarSpec, future: Future) -> None:
        """Take a compilation out of the cache (over its budget, or cancelled), and cancel it
        if it has not started: a later request for the spec compiles it anew."""
        key = GrammarSpec(spec.kind, spec.source)
        with self._lock:
            if self._cache.get(key) is future:
                del self._cache[key]
        future.cancel()

    def started_at(self, spec: GrammarSpec) -> Optional[float]:
        """When the spec's compilation started (time.monotonic()); None if it is not running."""
        return self._started.get(GrammarSpec(spec.kind, spec.source))

    def oldest_start(self) -> Optional[float]:
        """When the longest-running compilation now started; None if none runs."""
        return min(list(self._started.values()), default=None)  # a copy: threads add and remove

    def _compile(self, spec: GrammarSpec):
        self.num_started += 1
        self._started[spec] = time.monotonic()
        try:
            return self._xgr_compiler().compile_grammar(parse_grammar(spec))
        finally:
            self._started.pop(spec, None)

    def _xgr_compiler(self):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                from transformers import PreTrainedTokenizerFast

                tokenizer = PreTrainedTokenizerFast(tokenizer_file=self._tokenizer_file)
                # Each request's matcher overrides the stop tokens with its own (RequestGrammar).
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._eos_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """A compile thread's initializer: nice it (Linux sets the priority per thread id)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS)
    except (OSError, AttributeError):  # not Linux, or not allowed: the same priority
        pass
