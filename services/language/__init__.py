"""The language service: receives embeddings, runs prefill/decode, streams tokens."""
