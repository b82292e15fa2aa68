"""Bad input, told in one line.

Every error a user can cause (a missing file, a bad option, a corrupt checkpoint) is an
`InputError` or an `OSError` whose message names the file, tensor, row or option and what
was expected. The command lines run inside `reported()`: such an error prints
`error: <message>` on stderr and exits with status 2, without a traceback. Anything else
is a bug in dsv4 and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class InputError(ValueError):
    """Input the user gave (a file, an option, a request) is not what it must be."""


def option_name(name: str) -> str:
    """A Python keyword as its command-line option: top_p -> --top-p."""
    return "--" + name.replace("_", "-")


def message(error: BaseException) -> str:
    """The error's one line: an OSError's text with the path it names."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def reported() -> Iterator[None]:
    """Run a command line's body: bad input exits 2 with one line, Ctrl-C exits 130 quietly."""
    try:
        yield
    except (InputError, OSError) as error:
        print(f"error: {message(error)}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_INPUT) from None
    except KeyboardInterrupt:
        print(file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
