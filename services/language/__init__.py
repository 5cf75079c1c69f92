"""The language service: receives embeddings, runs prefill/decode, streams tokens.

servicer.py   the Language gRPC servicer: protobuf at the edge, errors as statuses
frontend.py   the request path: render, receive the embeddings, generate
kv_handoff.py E/P/D: a prefill instance hands a request's KV pages to a decode one
prefix_moves.py a chat's KV pages fetched from the instance that holds them
server.py     `epd language`: assembles the service and runs it
config.py     LanguageConfig
metrics.py    the language service's Prometheus metrics
engine/       the engine loop and its hosts
"""
