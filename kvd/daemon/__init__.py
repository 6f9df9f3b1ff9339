"""The daemon's insides, one module per stage of the data path.

ingest (``sockets``) -> ``validate`` -> ``batcher`` -> ``executor`` -> ``publisher``, with the
request state in ``ledger`` and the attached caches in ``registry``; ``server`` runs the
lifecycle and ``control`` answers the control socket. Nothing outside this package imports it
except the ``kvd serve`` command and tools that start or configure a daemon.
"""
