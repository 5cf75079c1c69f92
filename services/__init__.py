"""EPD: encode/language disaggregated serving for vision-language models.

The services, each a process of its own (docs/architecture.md has a request's path):
gateway/      the OpenAI-compatible REST gateway
broker/       registration, routing, the transfer rendezvous; the instances' end of it
encoder/      images in, embeddings out to a language instance (through Triton)
language/     the language service and its engine loop
triton/       a local Triton Inference Server for the vision tower

What they are built on:
layers/       the networks and kernels, for the language engine and Triton's tower
transfer/     the embedding data plane: pools, allocators, transports
media/        what a request's images and videos may be, decoded within limits
model/        a checkpoint's spec, weights, tokenizer, prompts; the demo checkpoints
wire/         what crosses between processes, as dataclasses; the one converter
proto/        generated from protos/ (`epd protos`): never edited by hand
runtime/      what every process shares: env, logs, ports, gRPC servers, tracing

And around them:
launcher/     the `epd` command: each component, `epd serve`'s stack, supervision
loadgen/      `epd bench`, the load generator
monolithic.py the monolithic baseline: the whole model in the gateway's process
"""
