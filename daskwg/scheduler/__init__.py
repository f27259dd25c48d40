"""The scheduler side: plugins the Dask scheduler runs. It never imports torch.

* ``release``: :class:`ReleaseOnClientExit`, a departed driver's ranks released.
* ``dashboard``: the ``<dashboard>/daskwg`` page and the ``daskwg_*`` Prometheus series.
* ``metrics``: the workers' call counters added together (each worker counts its own in
  ``daskwg.plugin.metrics``).
"""
