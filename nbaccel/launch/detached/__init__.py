"""Runs that outlive the kernel: a per-user supervisor, run folders, replay.

A detached launch is written to a run folder (:mod:`.folder`) and handed to the user's
supervisor (:mod:`.supervisor`, reached through :mod:`.client` on a 0600 Unix socket), which
starts a runner process per run (:mod:`.runner`): the normal launch engine with a renderer that
records every call into the folder's journal (:mod:`.recorder`, :mod:`.journal`). Any process
can replay a journal into any renderer (:mod:`.replay`) and read the run's result
(:mod:`.handle`). Nothing here knows notebooks: the kernel side chooses the renderer.
"""
