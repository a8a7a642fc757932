"""Ed25519 private keys on disk: created once (0600, never overwritten), and
refused when others could have read them.

The node's signer and the reference control plane keep their keys this way.
The key is unencrypted PKCS#8 PEM; its protection is the file mode and the
owning user. A key file group or others can read is refused, since it may
already have leaked.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from nacl.signing import SigningKey

from shared.ed25519der import DerError, private_key_from_pem, private_key_pem
from shared.fsutil import fsync_dir

#: the private key type (PyNaCl's; see shared.signing).
Ed25519PrivateKey = SigningKey


class KeyFileError(Exception):
    """The key file is unsafe or unreadable; the text says what to do."""


def load_or_create_key(path: Path, owner: str = "this process") -> tuple[Ed25519PrivateKey, bool]:
    """Return (key, created)."""
    path = Path(path)
    try:
        # O_NONBLOCK: a FIFO at the key's path must not hang the signer (fstat refuses it below)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        return _create(path, owner), True
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise KeyFileError(f"{path}: is a symlink; refusing to follow it") from None
        raise KeyFileError(f"{path}: cannot open ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"{path}: not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise KeyFileError(
                f"{path}: key file is readable by others (mode {mode:04o}); "
                f"it may have leaked: chmod 600 it if you are sure it did not, or remove it to make a new key"
            )
        if st.st_uid != os.geteuid():
            raise KeyFileError(f"{path}: owned by uid {st.st_uid}, not by {owner} (uid {os.geteuid()})")
        data = f.read(64 * 1024)  # a PEM Ed25519 key is ~120 bytes
    try:
        seed = private_key_from_pem(data)
    except DerError as exc:
        if str(exc).startswith("key is not Ed25519"):
            raise KeyFileError(f"{path}: not an Ed25519 key ({str(exc)[len('key is not Ed25519 ') :].strip('()')})") from None
        raise KeyFileError(f"{path}: {exc}") from None
    return SigningKey(seed), False


def _create(path: Path, owner: str) -> Ed25519PrivateKey:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = SigningKey.generate()
    pem = private_key_pem(bytes(key))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        # link(2) fails when another process made the key meanwhile: never overwrite a key.
        os.link(tmp, path)
    except FileExistsError:
        os.unlink(tmp)
        key, _ = load_or_create_key(path, owner)
        return key
    os.unlink(tmp)
    fsync_dir(path.parent)
    return key


__all__ = ["KeyFileError", "load_or_create_key"]
