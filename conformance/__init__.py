"""The conformance suite: statistical and exact checks that plug-ins keep the target's law.

This package also holds the *negative controls*: deliberately broken components that the suite
must reject.  They are never registered through an entry point, only by tests.
"""
