"""The broker: registration, routing and the embedding-transfer rendezvous."""
