"""Model builders: decoder-only LMs from transformers configs (no downloaded weights)."""
