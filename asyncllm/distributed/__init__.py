"""Tensor parallelism across processes: the process group (parallel_state) and the collectives
the models call (communication_op)."""
