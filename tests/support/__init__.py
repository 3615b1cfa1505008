"""Helpers the test modules share (a rig, a snapshot, a tool finder): imported by tests instead of
one test module importing another. The stand-in servers and doubles are in :mod:`tests.fakes`."""
