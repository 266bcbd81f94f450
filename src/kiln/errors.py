"""The one exception type that the `kiln` command turns into a clean message and a non-zero exit."""


class KilnError(Exception):
    """A problem with the user's input (a path, a config key, a checkpoint) that names what to do.

    The CLI prints `kiln: error: <message>` and exits with status 2, without a traceback; library
    callers catch it like any exception.
    """
