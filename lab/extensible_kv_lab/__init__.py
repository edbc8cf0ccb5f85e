"""The lab of extensible-kv: what its GPU runs write and how they are judged, apart from the runtime.

- ``measurements``: the schema of every measurement file a run writes (pydantic models) and the one reader;
- ``parity``: greedy-parity outcomes of a case's legacy and extensible runs;
- ``report``: the memory-accounting report of a run folder (``extensible-kv report``, ``bench-summary``).

The runtime (``extensible_kv``) never imports this package; its command line loads ``report`` when one of those two
commands runs.
"""
