"""Attention backends and their selection."""
