"""The text pipeline: request validation and prompts (chat templates) on the way in; incremental
detokenization, stop strings, logprobs' token texts, reasoning and tool-call parsing on the way
out. It imports the engine's plain types, server/config.py and server/errors.py, never a front,
ops or the core."""
