"""Process exit codes of ``python -m jddp.train`` (the user-visible contract)."""

SUCCESS = 0
FAILURE = 1  # any other failure; one-line cause on stderr
BAD_INPUT = 2  # bad config or command line; the message names the key
PREEMPTED = 75  # EX_TEMPFAIL: SIGTERM/SIGUSR1 arrived, a checkpoint was saved; rerun to continue
