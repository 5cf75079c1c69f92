"""The OpenAI-compatible REST gateway. A request goes down this list:

admission.py    at most --max-concurrent-requests in flight; gauges, log, root span
app.py          the FastAPI routes over a Gateway
prepare.py      an OpenAI request read into a GenerateCall (wire types, sampling)
protocol.py     the OpenAI requests as validated models
media.py        a request's images and videos loaded from data: and http(s) URLs
backend.py      the gRPC side: Route at the broker, Encode, Generate with failover
streams.py      many Generate calls to one language instance on one stream
streaming.py    the answer as server-sent events
shapes.py       the answer's shapes, and a call's whole output collected
responses/      the Responses API, a translation onto the chat path
tool_calls.py   tool calls in the Hermes format the Qwen models are trained on
errors.py       ApiError: OpenAI-style errors, and gRPC statuses mapped to them
request_log.py  one log line per request
server.py       `epd gateway`: the app under uvicorn
config.py       GatewayConfig
metrics.py      the gateway's Prometheus metrics
"""
