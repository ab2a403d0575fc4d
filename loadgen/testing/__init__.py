"""Test support: a toy engine and a toy OpenAI server for loadgen's own plumbing tests."""
