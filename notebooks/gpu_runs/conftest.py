"""The executed GPU notebooks here are records (issue 29): they ran at ``scale="gpu"`` on a GPU and are read back by
``check_ledger.py`` and ``tests/test_gpu_runs.py``, never executed by nbval — on a CPU CI machine they would train
the GPU scale's models for hours. ``pytest`` (``testpaths`` holds ``notebooks``) therefore collects nothing here."""

collect_ignore_glob = ["*.ipynb"]
