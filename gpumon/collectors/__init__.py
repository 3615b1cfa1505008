"""Collectors: one module per source, each knowing its source's quirks and nothing about sinks."""
