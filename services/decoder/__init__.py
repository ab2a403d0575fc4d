"""Decoder: a Ray Serve deployment per GPU (or CPU) that owns an ``LLMEngine``.

``messages`` holds what the router sends and receives, ``engine_loop`` steps the engine on
a background thread and forwards each output's delta (``detserve.output_processor``),
``engine_factory`` wires the verifier (in-process or remote), ``deployment`` is the
Serve class.
"""
