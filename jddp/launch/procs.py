"""Moved: the shared supervision is :mod:`jddp.launch.supervise`, the local launcher's
:class:`jddp.launch.local.Launcher`; this name keeps old imports working."""

from jddp.launch.supervise import catches, describe_exit, exit_code_for, failure_report  # noqa: F401
