"""Tensors and arithmetic: the KV pool, reduction policies (ops), attention, the runner."""
