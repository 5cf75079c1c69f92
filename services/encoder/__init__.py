"""The encoder service: images in, embeddings out to a language instance."""
