"""One exception for user mistakes, and the exit path that turns it into a clear message."""
import sys


class UsageError(Exception):
    """A mistake the user can fix: bad flag value, missing data, wrong checkpoint.

    The scripts catch it at the top, print one line and exit with code 2.
    """


def exit_on_usage_error(main):
    """Run main(); turn a UsageError into 'prog: error: ...' on stderr and exit code 2."""
    import os
    prog = os.path.basename(sys.argv[0])
    try:
        return main()
    except UsageError as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        sys.exit(2)


def one_line(err):
    """The message of a UsageError, also when a DataLoader worker re-raised it with its traceback."""
    text = str(err)
    if "Original Traceback" in text:
        text = text.strip().splitlines()[-1]
        text = text.split("UsageError: ", 1)[-1]
    return text


def first_line(err, limit=300):
    """The first line of an exception's message (or its type name), for one-line error summaries."""
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:limit]
