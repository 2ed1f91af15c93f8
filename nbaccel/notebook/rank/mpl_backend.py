"""A matplotlib backend for pool workers: figures reach the notebook as PNG display bundles.

The pool sets ``MPLBACKEND=module://nbaccel.notebook.rank.mpl_backend`` on its workers. Drawing uses
Agg; ``plt.show()`` and the end of every ``%%distributed`` cell send the open figures to the
notebook under the rank's label (as the inline backend does in a kernel), then close them.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from matplotlib._pylab_helpers import Gcf
from matplotlib.backends.backend_agg import FigureCanvasAgg

from nbaccel.notebook.rank.publish import publish

__all__ = ["FigureCanvas", "figure_bundle", "send_figures", "show"]

FigureCanvas = FigureCanvasAgg


def figure_bundle(figure: Any) -> dict[str, str]:
    """A display bundle for one figure: PNG plus a text fallback."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    width, height = figure.get_size_inches() * figure.dpi
    return {
        "image/png": base64.b64encode(buffer.getvalue()).decode("ascii"),
        "text/plain": f"<Figure size {width:g}x{height:g} with {len(figure.axes)} Axes>",
    }


def send_figures() -> int:
    """Publish every open figure to the notebook and close it; returns how many were sent."""
    managers = Gcf.get_all_fig_managers()
    for manager in managers:
        publish(figure_bundle(manager.canvas.figure))
    Gcf.destroy_all()
    return len(managers)


def show(*args: Any, **kwargs: Any) -> None:
    """``plt.show()`` on a worker: send the open figures now."""
    send_figures()
