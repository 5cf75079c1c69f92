"""What every EPD process shares at run time.

env.py          EPD_* environment variables, declared once
logs.py         text or JSON log lines
ports.py        each service's default port, free ports on loopback, claims on ports
grpc_server.py  a gRPC server with health, reflection, keepalive and metrics
security.py     the cluster token and TLS for gRPC servers and channels
tracing.py      OpenTelemetry spans, and the recent ones kept for `epd trace`
children.py     child processes that end when their parent does
malloc.py       the C allocator's settings for a process that runs torch
"""
