"""The check that a checkpoint directory is one all ranks share, made when a manager opens it.

Rank 0 creates the directory, writes a probe file there (and claims the world's fencing
token, :mod:`._fence`); every rank must read the probe back. Done at once, not at the
first save steps (or hours) later: a directory rank 0 cannot write, or one that some
node does not share (a node-local disk, a missing mount), would make ranks restore
different checkpoints, or none.
"""

from __future__ import annotations

import secrets

from elastictrain.errors import CheckpointDirectoryError, CheckpointError

from . import _fence
from . import _manifest as fmt
from .coordinator import Coordinator
from .storage import ObjectStore, Storage, delete_quietly

__all__ = ["check"]


def check(storage: Storage, prefix: str, coord: Coordinator, *, host: str, claim: bool) -> int | None:
    """Check that every rank sees ``prefix`` in ``storage`` as rank 0 wrote it; a collective.

    Args:
        host: This rank's host name, named in the error if it cannot see rank 0's probe.
        claim: Claim a fencing token in the directory (rank 0, for the whole world).

    Returns:
        The world's fencing token (None unless ``claim``).

    Raises:
        CheckpointDirectoryError: The directory cannot be made or written, or some rank cannot
            read what rank 0 wrote (every rank raises it).
        CheckpointError: A token cannot be claimed.
    """
    location = storage.location(prefix)
    rank0 = coord.rank == 0
    setup: tuple[str, str, int | None] | CheckpointError | None = None
    if rank0:
        setup = _write_probe(storage, prefix, location, claim)
    try:
        setup = coord.broadcast(setup)
    except CheckpointError:
        if rank0 and not isinstance(setup, CheckpointError) and setup is not None:
            delete_quietly(storage, setup[0])
        raise
    if isinstance(setup, CheckpointError):
        raise setup
    assert setup is not None  # noqa: S101 - rank 0 always sends a setup or an error
    probe, nonce, token = setup
    seen = True
    if not rank0:
        try:
            with storage.open_read(probe) as f:
                seen = f.read() == nonce.encode()
        except OSError:
            seen = False
    views = coord.all_gather((seen, host))
    if rank0:
        delete_quietly(storage, probe)
    blind = [(rank, host) for rank, (ok, host) in enumerate(views) if not ok]
    if blind:
        hosts = ", ".join(sorted({host for _, host in blind}))
        ranks = ", ".join(str(rank) for rank, _ in blind)
        if isinstance(storage, ObjectStore):
            raise CheckpointDirectoryError(
                f"checkpoint location {location} is not the same for all ranks: host(s) {hosts} (rank(s) {ranks}) "
                f"cannot read the object rank 0 (host {views[0][1]}) wrote there; every node must reach the same "
                "endpoint (AWS_ENDPOINT_URL) with credentials that may read the bucket")
        raise CheckpointDirectoryError(
            f"checkpoint directory {location} is not on a filesystem shared by all ranks: host(s) {hosts} "
            f"(rank(s) {ranks}) cannot see the file rank 0 (host {views[0][1]}) wrote there; mount one shared "
            "filesystem (NFS, Lustre, a ReadWriteMany volume) at this path on every node"
        )
    return token


def _write_probe(storage: Storage, prefix: str, location: str,
                 claim: bool) -> tuple[str, str, int | None] | CheckpointError:
    try:
        storage.make_dir(prefix)
    except OSError as exc:
        return CheckpointDirectoryError(f"cannot create checkpoint directory {location}: {exc}")
    nonce = secrets.token_hex(8)
    probe = fmt.join(prefix, f".probe-{nonce}")
    try:
        with storage.open_write(probe) as f:
            f.write(nonce.encode())
    except OSError as exc:
        return CheckpointDirectoryError(f"checkpoint directory {location} is not writable: {exc.strerror or exc}")
    try:
        token = _fence.claim(storage, prefix) if claim else None
    except OSError as exc:
        delete_quietly(storage, probe)
        return CheckpointError(f"cannot claim a fencing token in {location}: {exc}")
    except CheckpointError as exc:
        delete_quietly(storage, probe)
        return exc
    return probe, nonce, token
