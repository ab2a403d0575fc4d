"""Llama-architecture model, weight loaders and tokenizer."""
