"""The broker: registration, routing and the embedding-transfer rendezvous, and
the instances' end of it.

broker.py      Broker: the registry and the rendezvous behind the servicer
registry.py    the attached instances, their load, and the routing choice
placement.py   which encoder encodes a request's images (pure functions)
rendezvous.py  pairs EmbeddingMeta with Prealloc by request id, relays transfers
servicer.py    the Broker gRPC servicer: protobuf in and out
server.py      `epd broker`: the gRPC server and its periodic upkeep
config.py      BrokerConfig
metrics.py     the broker's Prometheus metrics
client.py      BrokerLink: an instance's end of the Attach stream
instance.py    InstanceServer: the lifecycle every attached instance runs
"""
