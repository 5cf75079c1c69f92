"""The load generator (`epd bench`): a serving benchmark against any
OpenAI-compatible server, and what the scripts under bench/ share with it.

command.py    `epd bench`: its options, the runs, the report
workload.py   chat requests with synthetic or folder images and videos
synthetic.py  synthetic images and videos, deterministic for a seed
runner.py     a workload against a server: Poisson or burst arrivals, a concurrency cap
client.py     one streamed chat completion, timed
summary.py    what a run measured: throughput, latency percentiles, goodput
stats.py      summary statistics of latency samples
plots.py      PNG plots: latency CDFs, throughput against request rate
"""
