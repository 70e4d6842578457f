"""How a linear layer stores its weights and runs its GEMM (base.py: the interface and the
unquantized method)."""
