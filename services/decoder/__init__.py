"""Decoder: a Ray Serve deployment per GPU (or CPU) that owns an ``LLMEngine``.

``messages`` holds what the router sends and receives, ``deltas`` turns committed engine
state into stream deltas, ``engine_loop`` steps the engine on a background thread,
``engine_factory`` wires the verifier (in-process or remote), ``deployment`` is the
Serve class.
"""
