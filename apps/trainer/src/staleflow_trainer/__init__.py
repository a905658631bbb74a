"""StaleFlow trainer app: thin wiring of the StaleFlow packages (train, simulate, compare).

Layout, one folder per job:

* ``cli`` — the ``staleflow`` command; ``config`` (with ``config_*``) — the app's config.
* ``runtime/`` — the driver side of ``staleflow train`` (start, watch and stop the deployment);
  ``actors/`` — the Ray actors it starts.
* ``control/`` — the control core: every decision of a run, shared by both shells.
* ``sim/`` and ``simulate`` — the simulator and ``staleflow simulate``.
* ``report/`` — what a run reports (metrics, progress, trackers, plots) and how runs are
  compared (``staleflow compare``, ``staleflow plan``).
* ``trainer/``, ``data/``, ``reward/``, ``tiny_model`` — training, datasets, rewards, local
  tiny models; ``profiling`` — ``staleflow profile``; ``errors``, ``atomic_files`` — shared.
"""

__version__ = "0.1.0"
