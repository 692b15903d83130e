"""Tools that tool episodes call, each runnable as a SubprocessEnvironment worker; this package
imports nothing, so a worker starts at the cost of Python and its own imports."""
