"""Private run files: every directory clawray writes a run into is 0700 and every file 0600, like the
records (:mod:`clawray.records`), so other users of the machine cannot read conversations, weights,
metrics or the wandb files.

Owns: the modes (0700, 0600) and the umask 077. Must not: choose what is private or when: its callers
do (the CLI, the driver, checkpoints, the metrics log, the run lock, ``clawray serve``).

Two layers: ``clawray run`` sets the umask 077 before Ray starts (:func:`private_umask`), so every
process of a local run (driver, Ray workers, the wandb service) creates private files; and the driver
tightens what it owns explicitly (:func:`private_dir`, :func:`open_private`, :func:`private_tree` on each
committed checkpoint and the wandb folder), which holds whatever the umask of the writer was (a library
use of ``Driver``, workers on other nodes of a cluster).
"""

from __future__ import annotations

import os

DIR_MODE, FILE_MODE = 0o700, 0o600


def private_umask() -> int:
    """Set the process umask to 077 (new files 0600, new directories 0700); returns the old umask."""
    return os.umask(0o077)


def private_dir(path: str) -> str:
    """Create ``path`` (and missing parents) and make ``path`` itself 0700; returns it."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    os.chmod(path, DIR_MODE)
    return path


def open_private(path: str, mode: str = "w"):
    """``open(path, mode)`` for text writing (``"w"``, ``"a"``, or ``"a+"``: appending, and readable) of a
    file that is 0600 from its creation on."""
    access = os.O_RDWR if "+" in mode else os.O_WRONLY
    flags = access | os.O_CREAT | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    fd = os.open(path, flags, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # an existing file keeps its mode through os.open
    return os.fdopen(fd, mode)


def private_tree(root: str) -> None:
    """Make ``root`` and every directory under it 0700 and every regular file 0600 (links are left alone)."""
    if not os.path.isdir(root):
        return
    os.chmod(root, DIR_MODE)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, DIR_MODE)
        for f in filenames:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p) and os.path.isfile(p):
                os.chmod(p, FILE_MODE)
