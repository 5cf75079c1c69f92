"""A request's images and videos: what they may be, and their untrusted bytes
read within those limits. The gateway checks them before routing, the encoder
again before preprocessing; both take the rules from here.

limits.py  ImageLimits: bytes, pixels, counts, video length and frames
decode.py  images and videos decoded (or only their headers read) within limits
"""
