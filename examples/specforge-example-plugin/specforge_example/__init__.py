"""An example specforge plug-in package (see plugin.py)."""
