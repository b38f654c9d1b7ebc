"""Renderers, functions of a `MemoryReport` (`vramtrace.report`): terminal, JSON, HTML, memory_viz snapshot, Chrome
trace events, fit and serve tables. They never import torch."""
