"""The mechanics explorer: ``python -m decoderlab.explore CKPT`` serves a page that shows each switchable mechanism
at work on a checkpoint and a prompt (``--save report.html`` writes the same views into one file).

``measure`` holds the measurements (functions of a model and token ids, no browser), ``views`` turns them into
HTML, ``app`` lays the views out in Gradio (imported only when a page is served), ``loading`` reads checkpoints,
``cli`` is the command line.
"""

from .cli import main
from .loading import ExploreError, load
from .views import Explorer

__all__ = ["Explorer", "ExploreError", "load", "main"]
