"""The embedding data plane: block allocator, embedding pools, transports."""
