"""The wire layer, at the bottom of the package graph: what crosses between
instances, and nothing that does I/O.

dtypes.py     the dtypes by name (one table) and what `auto` picks
transport.py  the transports, their preference, the choice per pair
messages.py   the control-plane messages as dataclasses named as in the protos
request.py    a request and its response stream as dataclasses (the request path)
convert.py    one generic conversion between those dataclasses and protobuf

Every package may import it; it imports no package of services/ but the
generated protos.
"""
