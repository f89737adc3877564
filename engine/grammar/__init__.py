"""Structured outputs: the grammar process (process.py) owns every matcher (request_grammar.py)
and compiles grammars (compiler.py); it fills the token bitmasks of each constrained step
(batch.py) into shared memory that the device reads and waits on (channel.py); bitmask.py
applies them to logits. Nothing here runs for a batch without a constrained request."""
