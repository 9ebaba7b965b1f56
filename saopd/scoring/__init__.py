"""Training-time adapters between models and the tensor layer (scoring)."""
