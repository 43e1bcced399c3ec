"""astrai: one attention entry point for PyTorch models."""
