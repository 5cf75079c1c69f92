"""The OpenAI-compatible REST gateway."""
