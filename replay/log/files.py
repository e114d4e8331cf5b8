"""The file seam of the replay log: every file operation goes through `FileSystem`, so that
tests can inject a file layer that drops unsynced bytes at a crash."""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable
from typing import Protocol

from replay.errors import ReplayError


class AppendFile(Protocol):
    """An open file that is only ever appended to (or cut back)."""

    def write(self, data: bytes | bytearray) -> None: ...  # writes every byte or raises
    def sync(self) -> None: ...  # returns once written bytes are durable
    def truncate(self, size: int) -> None: ...
    def size(self) -> int: ...
    def close(self) -> None: ...


class FileSystem(Protocol):
    """The few file operations the log needs."""

    def list_dir(self, path: str) -> list[str]: ...
    def make_dirs(self, path: str) -> None: ...
    def is_dir(self, path: str) -> bool: ...
    def read_bytes(self, path: str) -> bytes: ...
    def open_append(self, path: str) -> AppendFile: ...  # creates the file when missing
    def sync_dir(self, path: str) -> None: ...  # makes created file names durable
    def lock(self, path: str) -> Callable[[], None]: ...  # exclusive; returns the release


class OsAppendFile:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)

    def write(self, data: bytes | bytearray) -> None:
        # Views are released even on error: the log's bytearray buffer must stay resizable.
        with memoryview(data) as view:
            written = os.write(self._fd, view)
            while written < len(view):
                with view[written:] as rest:
                    written += os.write(self._fd, rest)

    def sync(self) -> None:
        # fdatasync also persists the file size, which is all an append changes.
        (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(self._fd)

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        os.close(self._fd)


class OsFileSystem:
    """The real file system."""

    def list_dir(self, path: str) -> list[str]:
        return os.listdir(path)

    def make_dirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def read_bytes(self, path: str) -> bytes:
        # A copy, not a map: a writer reopening the log cuts a torn tail off the newest segment,
        # and touching a mapped page past the new end of a file kills the process (SIGBUS).
        # Bytes read are ours whatever happens to the file afterwards.
        with open(path, "rb", buffering=0) as file:
            return file.readall()

    def open_append(self, path: str) -> OsAppendFile:
        return OsAppendFile(path)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Replace `path` with `data` all at once: a reader sees the old file, the whole new
        one, or none, never a part (temp file, fsync, rename, directory fsync)."""
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self.sync_dir(os.path.dirname(path))

    def remove(self, path: str) -> None:
        os.unlink(path)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def lock(self, path: str) -> Callable[[], None]:
        """An advisory exclusive lock (flock), released by the returned function or when the
        process dies: two writers appending to one log would interleave their frames."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ReplayError(f"the replay log in {os.path.dirname(path)} is open for writing "
                              f"by another process or handle") from None

        def release() -> None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

        return release

