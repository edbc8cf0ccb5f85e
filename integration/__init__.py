"""vLLM 0.26.0 integration: layout tests (CPU) and greedy-parity cases (GPU)."""
