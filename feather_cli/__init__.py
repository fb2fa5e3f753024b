"""The command-line layer: ``feather`` and ``feather-train``, thin shells over the library packages.

It sits on top of every other package and holds no logic of its own: each module defines one
command group's flags (:mod:`feather_cli.options` holds the flags shared by several groups) and
calls the library function that does the work, then prints its report.
"""
