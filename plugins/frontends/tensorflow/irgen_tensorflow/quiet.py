"""Keeping TensorFlow's and TVM's native log lines off irgen's stderr.

TensorFlow, its converter (MLIR) and TVM's C++ code write straight to file
descriptors 1 and 2 (``LOG(WARNING)`` lines, e.g. TVM's "BlockBuilder destroyed
with remaining blocks!" when an import fails half way); a user error must stay
one ``irgen: error:`` line. :func:`captured_fds` routes both descriptors into a
temporary file for the duration of a call; :func:`quiet_tensorflow` sets
TensorFlow's and absl's log levels before TensorFlow is imported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from typing import Any, Iterator


def quiet_tensorflow() -> None:
    """Before TensorFlow is imported: C++ logs off (errors included: irgen reports
    them itself), absl's Python logger and TensorFlow's own at ERROR."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    os.environ.setdefault("ABSL_MIN_LOG_LEVEL", "3")
    for name in ("absl", "tensorflow", "keras", "h5py"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def captured_fds() -> Iterator[Any]:
    """Route fd 1 and 2 into a temp file; yields the file (to build an error
    from, or to replay with :func:`replay`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as log:
        saved = (os.dup(1), os.dup(2))
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            yield log
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])


def captured_text(log: Any, limit: int = 1 << 20) -> str:
    log.flush()
    log.seek(0)
    return log.read(limit).decode(errors="replace")
