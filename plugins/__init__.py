"""The components that ship with specforge.

Each module here is a plug-in registered through the ``specforge`` entry-point group of the
``specforge-lossless`` distribution — the same path a third-party package uses.
"""
