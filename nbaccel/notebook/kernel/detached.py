"""Detached runs from the notebook: ``Run``, ``runs()`` and ``attach()``.

A launch with ``detach=True`` returns a :class:`Run` at once; its ranks run under this user's
supervisor (``nbaccel.launch.detached``) and outlive the kernel. Any kernel can list the runs
(:func:`runs`) and :func:`attach` to one: its output so far is replayed into the cell, then it
streams live, through the same renderer a launch uses (widgets in Jupyter, text elsewhere).
:meth:`Run.result` returns what ``notebook_launcher`` would have returned, or raises what it
would have raised: the rank's exception, with its original type, naming the rank.
"""

from __future__ import annotations

import html
import threading
from typing import Any

from nbaccel.launch.detached.handle import DetachedRun, RunStopped, current_runs
from nbaccel.launch.detached.listing import listing_text
from nbaccel.launch.driver.child_failed import as_child_failed
from nbaccel.launch.driver.renderer import Renderer
from nbaccel.notebook.kernel.widget_renderer import choose_renderer

__all__ = ["Run", "RunList", "RunStopped", "attach", "runs"]


class Run(DetachedRun):
    """A detached run (by id): attach to it, wait for its result, stop or resume it.

    Build one with ``nbaccel.attach(run_id)`` or from a detached launch's return value;
    ``Run(run_id)`` works too, in any process of the same user.
    """

    def attach(self, follow: bool = True, renderer: Renderer | None = None) -> Run:
        """Replay the run's output into this cell, then (``follow``) stream it live until the
        run ends. The stop button detaches (the run goes on); ``run.stop()`` stops it."""
        renderer = renderer or choose_renderer()
        stop = threading.Event()
        try:
            self.follow(renderer, follow=follow, stop=stop)
        except KeyboardInterrupt:
            print(f"[nbaccel] detached from run {self.id}; it goes on "
                  f"(nbaccel.attach({self.id!r}) to follow it again).")  # fmt: skip
        return self

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait for the run; the per-rank results, as ``notebook_launcher`` returns them, or
        the failing rank's exception (its type, naming the rank, its traceback) raised here.
        A stopped run raises :class:`RunStopped`."""
        __tracebackhide__ = True
        report = self.report(timeout)
        failure = report.exception()
        if failure is not None:
            if hasattr(failure, "rank"):
                failure = as_child_failed(failure, self.info.name)
            raise failure
        return report.values()

    def _repr_html_(self) -> str:
        return RunList([self.info])._repr_html_()


class RunList(list):
    """The runs of :func:`runs`: a list of ``RunInfo``, shown as a table."""

    empty = "no detached runs"  # what an empty list says

    def _rows(self) -> list[dict[str, str]]:
        return [info.row() for info in self]

    def __repr__(self) -> str:
        return listing_text(self._rows(), self.empty)

    def _repr_html_(self) -> str:
        rows = self._rows()
        if not rows:
            return f"<i>{html.escape(self.empty)}</i>"
        head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r.values()) + "</tr>"
            for r in rows
        )
        return f'<table class="nbaccel-runs"><tr>{head}</tr>{body}</table>'


def runs() -> RunList:
    """This user's detached runs, oldest first: id, name, state, ranks, hosts, started, and
    the last line printed."""
    return RunList(current_runs())


def attach(run_id: str | None = None, follow: bool = True) -> Run:
    """Attach to run ``run_id`` (default: the newest): replay its output into this cell, then
    stream it live until it ends (``follow``); the :class:`Run`, for ``.result()``."""
    if run_id is None:
        found = current_runs()
        if not found:
            raise ValueError("there are no detached runs to attach to; start one with "
                             "notebook_launcher(..., detach=True).")  # fmt: skip
        run_id = found[-1].id
    return Run(run_id).attach(follow=follow)
