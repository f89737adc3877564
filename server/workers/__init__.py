"""Text worker processes: the detokenizer (per-token work of every stream) and the tokenizer
pool (request preparation), out of the server process and its GIL."""
