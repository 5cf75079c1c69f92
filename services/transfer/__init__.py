"""The embedding data plane: block allocator, embedding pools, transports.

allocator.py        BlockAllocator: fixed-size token blocks from a free list
block_pool.py       BlockPool: a BlockAllocator that callers can wait on
embedding_pool.py   EmbeddingPool: blocks in memory a transport can reach
shared_memory.py    POSIX shared-memory segments for embedding pools
layout.py           PoolLayout and the token-run index math every transport shares
state.py            per-request transfer state, kept by both sides
sender.py           the sending side of each transfer, as a state machine
sender_driver.py    runs the Sender against the real world (timers, writes)
receiver.py         the receiving side of each transfer, as a state machine
receiver_driver.py  runs the Receiver against the real world
transports/         shm, NIXL, the gRPC stream and CUDA IPC
"""
