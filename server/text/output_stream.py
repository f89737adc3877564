"""One request's engine outputs -> GenerateChunks: text deltas, stop strings, usage, spec stats."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

from specserve.engine.outputs import StepOutput
from specserve.proto import generate_pb2 as pb
from specserve.server.text.detokenizer import DecodedWindows, IncrementalDetokenizer
from specserve.server.text.logprobs import TokenTexts
from specserve.server.text.stop_strings import StopStringMatcher
from specserve.server.text.validation import ValidatedRequest

_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                   "abort": pb.FINISH_REASON_ABORT}


class EngineProgress(NamedTuple):
    """The engine's speculative counters for one request, totals so far, and its prompt tokens
    served from the prefix cache."""

    verify_steps: int = 0
    accepted_drafts: int = 0
    accept_length: float = 1.0  # tokens per verify step; 1.0 before any verify
    cached_tokens: int = 0


def merge_chunks(chunks: list[pb.GenerateChunk]) -> pb.GenerateChunk:
    """One chunk for consecutive chunks of one sequence (a consumer slower than the engine
    takes them together). Every field a chunk carries must be merged here."""
    if len(chunks) == 1:
        return chunks[0]
    merged = pb.GenerateChunk(text="".join(chunk.text for chunk in chunks),
                              index=chunks[0].index)
    for chunk in chunks:
        merged.token_ids.extend(chunk.token_ids)
        merged.logprobs.extend(chunk.logprobs)
        if chunk.top_logprobs:  # messages: skipped when absent, as they mostly are
            merged.top_logprobs.extend(chunk.top_logprobs)
        if chunk.prompt_logprobs:  # on a sequence's first chunk only
            merged.prompt_logprobs.extend(chunk.prompt_logprobs)
    if chunks[-1].HasField("finish"):  # only a sequence's last chunk has one
        merged.finish.CopyFrom(chunks[-1].finish)
    return merged


class OutputStream:
    """Tokens are handled one at a time so that a stop string completed by the first of several
    tokens of a speculative step ends the stream right there: later tokens are not streamed."""

    def __init__(self, tokenizer: Any, request: ValidatedRequest, report_spec: bool,
                 token_texts: Optional[TokenTexts] = None):
        self.token_texts = token_texts or TokenTexts(tokenizer)
        self.detokenizer = (IncrementalDetokenizer(tokenizer, self.token_texts)
                            if tokenizer is not None else None)
        self.prompt_token_ids = request.prompt_token_ids
        self.wants_prompt_logprobs = request.sampling.prompt_logprobs is not None
        self.sent_prompt_logprobs = False
        self.stops = StopStringMatcher(request.stop_strings)
        self.min_new_tokens = request.sampling.min_new_tokens
        self.prompt_tokens = len(request.prompt_token_ids)
        self.report_spec = report_spec
        self.num_tokens = 0
        self.finished = False
        # The engine's running totals, from its latest output for this request.
        self._engine_completion_tokens = 0
        self.cached_tokens = 0
        self.verify_steps = 0
        self.accepted_drafts = 0

    def on_output(self, out: StepOutput,
                  decoded: Optional[DecodedWindows] = None) -> Optional[pb.GenerateChunk]:
        """The chunk to stream for one engine output (None if there is nothing to say).

        `decoded`: this output's detokenizer windows decoded beforehand, with other streams'
        (`decode_windows`). Sets `finished` when this chunk ends the stream; if that
        happened through a stop string, the engine has not finished the request and the caller
        must abort it. Outputs that arrive after that (the abort was in flight) say nothing.
        """
        if self.finished:
            return None
        self._engine_completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.verify_steps = out.num_verify_steps
        self.accepted_drafts = out.num_accepted_drafts
        # Each token's text delta, as if the tokens came one at a time; the detokenizer may
        # run past a stop string's token, which only ends the stream sooner.
        deltas = (self.detokenizer.add_each(out.new_token_ids, decoded) if self.detokenizer
                  else [""] * len(out.new_token_ids))
        # The chunk's fields are filled once, after the loop: this runs for every token of
        # every stream.
        kept, matched = len(deltas), None
        # Stop strings count from min_new_tokens on (see _text): with every token of the step
        # counting, one search of the step's text finds whether any token completes one.
        released = (self.stops.feed_all(deltas)
                    if self.stops.stop_strings and self.num_tokens + 1 >= self.min_new_tokens
                    else None)
        if released is not None:
            self.num_tokens += kept
            texts = [released]
        elif self.stops.stop_strings:  # token by token: which one completes a stop string
            texts = []
            for i, delta in enumerate(deltas):
                self.num_tokens += 1
                text, matched = self._text(delta)
                texts.append(text)
                if matched is not None:
                    kept = i + 1
                    break
        else:  # nothing to match: the text is the deltas
            self.num_tokens += kept
            texts = deltas
        text = "".join(texts)
        chunk = pb.GenerateChunk(token_ids=out.new_token_ids[:kept], text=text)
        prompt_logprobs = None
        if self.wants_prompt_logprobs and not self.sent_prompt_logprobs:
            # The engine sends them with the first output (the wire drops an empty list: a
            # one-token prompt).
            self.sent_prompt_logprobs = True
            prompt_logprobs = self.token_texts.prompt(
                self.prompt_token_ids, out.prompt_logprobs or [], out.prompt_top_logprobs)
            chunk.prompt_logprobs.extend(prompt_logprobs)
        if out.new_logprobs:
            chunk.logprobs.extend(out.new_logprobs[:kept])
        if out.new_top_logprobs:
            chunk.top_logprobs.extend(self.token_texts.top(top)
                                      for top in out.new_top_logprobs[:kept])
        if matched is not None:
            self._finish(chunk, pb.FINISH_REASON_STOP).matched_stop_str = matched
            return chunk
        if out.finished:
            text, matched = self._text(self.detokenizer.flush() if self.detokenizer else "")
            chunk.text += text
            if matched is not None:
                self._finish(chunk, pb.FINISH_REASON_STOP).matched_stop_str = matched
                return chunk
            chunk.text += self.stops.flush()
            finish = self._finish(chunk, _FINISH_REASONS.get(out.finish_reason,
                                                             pb.FINISH_REASON_UNSPECIFIED))
            if out.matched_stop is not None:
                finish.matched_token_id = out.matched_stop
            return chunk
        # (Read from the chunk's fields, this check would cost as much as building it.)
        return chunk if kept or text or prompt_logprobs else None

    def _text(self, delta: str) -> tuple[str, Optional[str]]:
        # Stop strings count only once min_new_tokens tokens exist, like EOS and stop ids.
        if self.num_tokens < self.min_new_tokens:
            return delta, None
        return self.stops.feed(delta)

    def _finish(self, chunk: pb.GenerateChunk, reason: int) -> pb.Finish:
        self.finished = True
        finish = chunk.finish
        finish.reason = reason
        finish.usage.prompt_tokens = self.prompt_tokens
        finish.usage.completion_tokens = self.num_tokens
        finish.usage.cached_tokens = self.cached_tokens
        if self.report_spec:
            finish.spec.verify_steps = self.verify_steps
            finish.spec.accepted_drafts = self.accepted_drafts
            finish.spec.accept_length = self.accept_length
        return finish

    @property
    def progress(self) -> EngineProgress:
        return EngineProgress(self.verify_steps, self.accepted_drafts, self.accept_length,
                              self.cached_tokens)

    @property
    def accept_length(self) -> float:
        """Tokens the engine generated per verify step so far; 1.0 before any verify."""
        return (self._engine_completion_tokens / self.verify_steps if self.verify_steps
                else 1.0)


# --- chunks as bytes: what the detokenizer worker sends and the event loop routes -------------
class ChunkPiece(NamedTuple):
    """One sequence's chunk of one engine step as the detokenizer worker sends it: the
    serialized GenerateChunk without its text (`body`), and the text as UTF-8. Pieces of one
    sequence join into one chunk by concatenating bytes (`join_pieces`), never parsing them."""

    body: bytes
    text: bytes
    num_tokens: int
    finished: bool       # the chunk has a finish (the sequence's last)
    finish_reason: int   # pb.FinishReason when finished


class ReadyChunk(NamedTuple):
    """A serialized GenerateChunk, ready to write (the gRPC front writes `data` as it is), with
    what the core reads of it; `message()` parses it (the OpenAI front)."""

    data: bytes
    index: int
    num_tokens: int
    finished: bool
    finish_reason: int

    def message(self) -> pb.GenerateChunk:
        return pb.GenerateChunk.FromString(self.data)


_TEXT_TAG = b"\x12"  # GenerateChunk.text: field 2, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def chunk_piece(chunk: pb.GenerateChunk) -> ChunkPiece:
    """The piece of a chunk (its text taken out)."""
    text = chunk.text.encode()
    chunk.text = ""
    finished = chunk.HasField("finish")
    return ChunkPiece(chunk.SerializeToString(), text, len(chunk.token_ids), finished,
                      chunk.finish.reason if finished else 0)


def merge_pieces(pieces: list[ChunkPiece]) -> ChunkPiece:
    """One piece for consecutive pieces of one sequence: the bodies concatenated (parsing
    concatenated messages merges them: repeated fields appended, the one finish kept, the index
    repeated), the texts joined."""
    last = pieces[-1]
    return ChunkPiece(b"".join(piece.body for piece in pieces),
                      b"".join(piece.text for piece in pieces),
                      sum(piece.num_tokens for piece in pieces), last.finished, last.finish_reason)


def join_pieces(index: int, pieces: list[ChunkPiece]) -> ReadyChunk:
    """One serialized chunk for consecutive pieces of one sequence: what `merge_chunks` makes
    of their chunks. The text, which a parser would replace rather than join, is written once,
    after the bodies (a parser takes fields in any order)."""
    piece = pieces[0] if len(pieces) == 1 else merge_pieces(pieces)
    data = piece.body + _TEXT_TAG + _varint(len(piece.text)) + piece.text \
        if piece.text else piece.body
    return ReadyChunk(data, index, piece.num_tokens, piece.finished, piece.finish_reason)
