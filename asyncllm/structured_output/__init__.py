"""Structured outputs with xgrammar: constraints checked in the front end, compiled in the engine
core off the step's path, and matched on the worker, which fills each step's token bitmask; with
speculative decoding the engine core cuts each constrained request's drafts to its grammar."""
