"""Fault injection for the environment tests (tests/cli/test_environment_failures.py), loaded by every Python
process started with this folder on PYTHONPATH: FAULT_WRITE=NAME makes writing a file whose name contains NAME
fail as a full disk does (ENOSPC); FAULT_MKDIR=NAME makes creating a directory whose path contains NAME fail as
a read-only file system does (EROFS); FAULT_OPEN=NAME makes opening a file whose path contains NAME for writing fail
as a full disk does (what matplotlib's savefig opens)."""

import builtins
import errno
import os
import pathlib

_WRITE, _MKDIR, _OPEN = os.environ.get("FAULT_WRITE"), os.environ.get("FAULT_MKDIR"), os.environ.get("FAULT_OPEN")

if _WRITE:
    def _refuse(original):
        def write(self, *args, **kwargs):
            if _WRITE in self.name:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
            return original(self, *args, **kwargs)
        return write

    pathlib.Path.write_text = _refuse(pathlib.Path.write_text)
    pathlib.Path.write_bytes = _refuse(pathlib.Path.write_bytes)

if _MKDIR:
    _mkdir = pathlib.Path.mkdir

    def _mkdir_refused(self, *args, **kwargs):
        if _MKDIR in str(self):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return _mkdir(self, *args, **kwargs)

    pathlib.Path.mkdir = _mkdir_refused

if _OPEN:
    _open = builtins.open

    def _open_refused(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and _OPEN in os.fspath(file) and set(mode) & set("wax+"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
        return _open(file, mode, *args, **kwargs)

    builtins.open = _open_refused
