"""What a run reports and how runs are compared.

* :mod:`~staleflow_trainer.report.metrics` — the run files: ``metrics.jsonl``,
  ``timeline.jsonl``, TensorBoard.
* :mod:`~staleflow_trainer.report.progress` — what a person watching sees: start-up phases, the
  progress bar or a line per step, the progress of many simulations.
* :mod:`~staleflow_trainer.report.trackers` — Weights & Biases beside them (off by default).
* :mod:`~staleflow_trainer.report.plots` — ``staleflow plot``: one run's PNGs.
* :mod:`~staleflow_trainer.report.compare` — ``staleflow compare``: every policy on one
  workload, side by side.
* :mod:`~staleflow_trainer.report.compare_plots` — the PNGs of a comparison.
* :mod:`~staleflow_trainer.report.plan` — ``staleflow plan``: which GPU split and η give the
  most throughput.
"""
