"""The `epd` command: what starts the stack and its tools, and imports no server.

cli.py       `epd` and its subcommands: one component each, `serve`, `bench`, ...
flags.py     every component's options, read into its config (one place each)
serve.py     `epd serve`: the stack on one host, its ports, health and supervision
planner.py   how many encoders `epd serve --encoders auto` runs
timeline.py  `epd trace REQUEST_ID`: a request's spans from every process
protogen.py  `epd protos`: services/proto/ generated from protos/ (and checked)
"""
