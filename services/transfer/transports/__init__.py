"""Data-plane transports. The encoder writes into receiver-allocated blocks:

- shm:      maps the language pool's POSIX shared-memory segments and copies runs
- nixl:     NIXL agent (UCX), WRITE of run descriptors with a notification
- grpc:     streams EmbeddingChunks to Language.PushEmbeddings
- cuda_ipc: opens the pool's CUDA IPC handle and copies on the device (GPU only)
"""
