"""The supported API for plug-in authors (docs/writing-a-plugin.md).

Everything a component needs beyond the contracts (:mod:`specforge.components`,
:mod:`specforge.protocols`, :mod:`specforge.hookspecs`) lives in this package's modules, and a
plug-in — shipped or third-party — imports only those and the contracts.  The package sits at the
bottom of the import layers: its modules never import the host, the engine or a job, so importing
one never drags a runtime in.  This file imports nothing on purpose.
"""
