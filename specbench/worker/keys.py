"""CURVE keys for a worker and a client, in the layout both expect (`specbench keys FOLDER`).

The folder holds `server.key(_secret)`, `client.key(_secret)` and `clients/`, the public keys a
worker admits. Secrets are 0600 and both folders 0700 whatever the umask; keys already there are
kept unless `force`: replacing them would lock out every worker and client that uses them.
"""
from __future__ import annotations

from pathlib import Path

from specbench.types import SpecbenchError


def make_keys(folder: str | Path, force: bool = False) -> Path:
    import zmq.auth

    folder = Path(folder)
    existing = [path.name for path in (folder / "server.key_secret", folder / "client.key_secret") if path.exists()]
    if existing and not force:
        raise SpecbenchError(f"{folder} already holds {', '.join(existing)}: new keys would lock out every worker and "
                             f"client using them. Pass --force to replace them")
    (folder / "clients").mkdir(parents=True, exist_ok=True)
    for path in (folder, folder / "clients"):  # only the owner may list or add keys
        path.chmod(0o700)
    for name in ("server", "client"):
        _, secret = zmq.auth.create_certificates(folder, name)
        Path(secret).chmod(0o600)  # a secret key readable by others is no secret
    (folder / "clients" / "client.key").write_bytes((folder / "client.key").read_bytes())
    return folder


def keys_command(args) -> int:
    """`specbench keys FOLDER [--force]`: make the keys and say where each side points."""
    folder = make_keys(args.folder, force=args.force)
    print(f"worker: --curve-keys {folder}  (clients allowed: {folder / 'clients'}/*.key)")
    print(f"client: RemoteTarget(..., curve_keys='{folder}')  (needs server.key and client.key_secret)")
    return 0
