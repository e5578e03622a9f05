"""Tests of the OpenAI-compatible HTTP front, tokenizers and detokenization."""
