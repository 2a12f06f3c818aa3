"""``python -m jddp.launch``: the launcher's command line (:func:`jddp.launch.main`), its
process ended by :func:`jddp.launch.command`."""

from jddp.launch import command

command()
