"""Sinks: each turns snapshots into one wire format without blocking the loop."""
