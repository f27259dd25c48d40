"""The scheduler side: plugins the Dask scheduler runs. It never imports torch.

* ``release``: :class:`ReleaseOnClientExit`, a departed driver's ranks released.
* ``dashboard``: the ``<dashboard>/daskwg`` page and the ``daskwg_*`` Prometheus series.
* ``metrics``: what every worker counts about its calls, and their merge.
"""
