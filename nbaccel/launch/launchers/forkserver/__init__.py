"""The fork server: a child of the kernel with torch (and what the kernel imports) preloaded,
from which ranks are forked. Reading order: ``launcher`` (the process's server, replaced when
it went stale, and the launcher that forks ranks from it), ``handle`` (the kernel's handle on one
server process), ``loop`` (the server process: its preloading, its protocol, its fork loop),
``kernel_modules`` (which of the kernel's imports the server mirrors), ``hold`` (pausing the
server's imports while ranks start), ``huge_pages`` (collapsing its memory before forks),
``reaper`` (what a rank starts stays below it).
"""
