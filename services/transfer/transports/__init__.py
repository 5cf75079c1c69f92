"""Data-plane transports. The encoder writes into receiver-allocated blocks:

shm.py          maps the language pool's POSIX shared-memory segments and copies runs
nixl.py         a NIXL agent (UCX): WRITE of run descriptors with a notification
grpc_stream.py  streams EmbeddingChunks to Language.PushEmbeddings
cuda_ipc.py     opens the pool's CUDA IPC handle and copies on the device (GPU only)
base.py         both ends of a transport: the encoder's Writer, the pool's end
ends.py         the one place that names each transport's classes
"""
