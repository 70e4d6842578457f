"""Structured outputs with xgrammar: constraints checked in the front end, compiled in the engine
core off the step's path, and matched on the worker, which fills each step's token bitmask."""
