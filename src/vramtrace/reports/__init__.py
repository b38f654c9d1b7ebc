"""Renderers: they take a MemoryReport (plain data) and never import torch."""
