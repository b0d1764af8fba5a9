"""Jupyter configuration for this repository: the GPU run records under notebooks/gpu_runs/ are read-only.

Jupyter reads no configuration from the folder it is started in (jupyter_server 2 searches ~/.jupyter, the
environment's etc/jupyter and the system's; checked with ``--debug``), so name this file when you start Lab, from
the repository root::

    jupyter lab --config=jupyter_server_config.py notebooks/

What it does, for every notebook under ``notebooks/gpu_runs/`` (each one the executed copy of a GPU call, a record
that ``docs/claims.md`` cites):

* the contents API reports it ``writable: false``: JupyterLab opens it read-only (a lock in the toolbar), never
  autosaves it, and answers Ctrl+S with "… is read-only. Use "Save as…" instead.";
* a save that comes anyway (another client, an older Lab, a copy or upload onto a record) is refused by a
  pre-save hook with HTTP 403 and the message below.

Opening a record still starts a kernel, and Lab then writes that kernel's Python version into the notebook's
``language_info``: the tab shows the unsaved dot, and nothing is saved. To run a record, save a copy outside
notebooks/gpu_runs/ (File > Save Notebook As…, e.g. as my_07.ipynb in notebooks/); to rerun it on a GPU, use
the command in its first cell. Every other notebook is saved as usual.

``--config`` replaces your own ``~/.jupyter/jupyter_server_config.py`` for this run (JSON configs and server
extensions still load); this file also sets ``ServerApp.contents_manager_class`` (Jupyter's default, with
``is_writable`` answering false for the records). ``tests/test_notebooks_open_clean.py`` checks both through a
real ``jupyter server``.
"""
from pathlib import Path

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager
from tornado.web import HTTPError

RECORDS = (Path(__file__).resolve().parent / "notebooks" / "gpu_runs").resolve()
REFUSAL = ("{path} is a read-only record of a GPU run (notebooks/gpu_runs/, see notebooks/GPU_RUNS.md): not saved. "
           "To change or run it, save a copy outside notebooks/gpu_runs/ (File > Save Notebook As…).")


def is_record(os_path) -> bool:
    """A notebook under notebooks/gpu_runs/ of this checkout (symbolic links resolved)."""
    path = Path(os_path).resolve()
    return path.suffix == ".ipynb" and RECORDS in path.parents


def refuse_record_saves(model, path, contents_manager, **kwargs):
    """Pre-save hook: an HTTPError rejects the save with its message (any other exception would be logged and the
    file saved anyway)."""
    if is_record(contents_manager._get_os_path(path)):
        raise HTTPError(403, REFUSAL.format(path=path))


class RecordsReadOnlyContentsManager(AsyncLargeFileManager):
    """Jupyter's default contents manager; the records are not writable (so Lab opens them read-only) and the
    pre-save hook refuses to save onto them."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_pre_save_hook(refuse_record_saves)

    def is_writable(self, path):
        if is_record(self._get_os_path(path.strip("/"))):
            return False
        return super().is_writable(path)


if "get_config" in globals():  # loaded by Jupyter as a config file (``--config``), not imported
    c = get_config()  # noqa: F821
    c.ServerApp.contents_manager_class = RecordsReadOnlyContentsManager
