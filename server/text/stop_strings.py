"""Stop strings over streamed text: find the first match, hold back what may start one."""
from __future__ import annotations

from typing import Optional, Sequence


class StopStringMatcher:
    """Feeds text deltas; releases only text that cannot be part of a stop string.

    Text whose tail is a proper prefix of some stop string is held back: if the next delta
    completes the stop string, nothing of it has been streamed; if not, it is released then.
    Because held text is always the longest such tail, a match can only start inside it, so
    searching the held text plus the new delta finds every match.
    """

    def __init__(self, stop_strings: Sequence[str]):
        self.stop_strings = tuple(stop_strings)
        self.held = ""
        # Every proper prefix of a stop string: the tails that must be held back (a set, as
        # this runs for every token of every stream).
        self._prefixes = frozenset(stop[:n] for stop in self.stop_strings
                                   for n in range(1, len(stop)))
        self._longest_prefix = max(map(len, self._prefixes), default=0)

    def feed(self, text: str) -> tuple[str, Optional[str]]:
        """Return (text safe to stream, the stop string that matched or None).

        After a match the returned text ends right before the stop string; the rest is dropped.
        """
        if not self.stop_strings:
            return text, None
        self.held += text
        match_at, matched = len(self.held), None
        for stop in self.stop_strings:
            i = self.held.find(stop)
            if i != -1 and i < match_at:
                match_at, matched = i, stop
        if matched is not None:
            released, self.held = self.held[:match_at], ""
            return released, matched
        keep = self._longest_tail_starting_a_stop()
        released, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return released, None

    def feed_all(self, texts: Sequence[str]) -> Optional[str]:
        """What feeding `texts` one at a time releases in all, when none of them completes a
        stop string (the usual case: one search per engine step instead of one per token);
        None, with nothing fed, when one does (the caller then feeds them one at a time).

        The same: without a match the per-text feeds release everything but the longest tail
        of all the text that is a proper prefix of a stop string, which is what stays held
        here (the held text always is that tail, so searching it covers all the text)."""
        held = self.held + "".join(texts)
        if any(stop in held for stop in self.stop_strings):
            return None
        self.held = held
        keep = self._longest_tail_starting_a_stop()
        released, self.held = held[:len(held) - keep], held[len(held) - keep:]
        return released

    def flush(self) -> str:
        """Release the held text (the stream ended without completing a stop string)."""
        released, self.held = self.held, ""
        return released

    def _longest_tail_starting_a_stop(self) -> int:
        for n in range(min(len(self.held), self._longest_prefix), 0, -1):
            if self.held[-n:] in self._prefixes:
                return n
        return 0
