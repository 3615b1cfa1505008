"""Tools for a checkout, not shipped in the wheel: ``python -m tools.<name>`` from the checkout's root."""
