"""Health verdicts: rules over every Snapshot, the inventory each Azure VM size should have, sticky
verdicts kept across restarts, and the actions taken on them (docs/health.md)."""
