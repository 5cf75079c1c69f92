"""The `epd` command: what starts the stack and its tools, and imports no server.

cli.py       `epd` and its subcommands: one component each, `serve`, `bench`, ...
options.py   every component's options, one table per config: flags, configs, serve's pass-on
flags.py     each subcommand's flags: its tables', and those that are no config field's
serve.py     `epd serve`: the stack on one host, its ports, health and supervision
preflight.py what `epd serve` refuses before it starts anything (one line, exit code 2)
planner.py   how many encoders `epd serve --encoders auto` runs
timeline.py  `epd trace REQUEST_ID`: a request's spans from every process
protogen.py  `epd protos`: services/proto/ generated from protos/ (and checked)
"""
