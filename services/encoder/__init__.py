"""The encoder service: images in, embeddings out to a language instance.

servicer.py       the Encoder gRPC servicer: protobuf at the edge, errors as statuses
pipeline.py       EncodePipeline: image and video bytes -> per-item embeddings
preprocess.py     bytes -> pixel patches and grids, with the checkpoint's HF processor
triton_client.py  the encoder's one door to Triton: the `vit` model
cache.py          EmbeddingCache: embeddings by content hash, LRU within a byte budget
peers.py          Peers: items fetched from the encoder that holds them, not encoded again
send_buffer.py    SendBuffer: embeddings waiting for their transfer, in a fixed pool
server.py         `epd encoder`: assembles the service and runs it
config.py         EncoderConfig
metrics.py        the encoder's Prometheus metrics
"""
