"""``hmp-keygen DIR --nodes ID ... [--client NAME ...] [--config FILE]``: the CURVE keys of a job.

Writes, into ``DIR``, one keypair per node, one for the launcher (sender id ``launcher``), one per
``--client`` (a program outside the topology, e.g. a monitoring client), and the job's server keypair
``server``: ``NAME.key`` (public) and ``NAME.key_secret`` (secret, mode 0600), pyzmq's certificate
format. Every public key in ``DIR`` is allowed to connect (docs/security.md); delete a ``.key`` file
and restart the job to revoke it. Existing files are kept unless ``--force`` (a running job's keys
must not change under it). Exit 0, or 2 for bad arguments (e.g. an invalid name, a file in the way).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from zmq.auth.certs import create_certificates

from hmp.transport.security import SERVER_KEY

_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="hmp-keygen", description="Write the CURVE keypairs of a job (docs/security.md).")
    ap.add_argument("dir", help="folder for the key files (made if missing; [security] key_dir points here)")
    ap.add_argument("--nodes", nargs="*", default=[], metavar="ID", help="node ids, one keypair each")
    ap.add_argument("--config", help="also every node id of this job config's [[nodes]]")
    ap.add_argument("--client", action="append", default=[], metavar="NAME",
                    help="a client outside the topology (its sender id); may be repeated")
    ap.add_argument("--force", action="store_true", help="replace existing key files")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    names = list(args.nodes)
    if args.config:
        from hmp import job
        from hmp.errors import ConfigError

        try:
            names += [n.id for n in job.load(args.config).nodes]
        except ConfigError as exc:
            print(f"hmp-keygen: config error: {exc}", file=sys.stderr)
            return 2
    if not names and not args.client:
        print("hmp-keygen: no names: give --nodes ID ... and/or --config FILE, --client NAME", file=sys.stderr)
        return 2
    wanted = [SERVER_KEY, "launcher"] + [n for n in dict.fromkeys(names + args.client) if n not in (SERVER_KEY,
                                                                                                    "launcher")]
    for n in wanted:
        if not _NAME.fullmatch(n):
            print(f"hmp-keygen: {n!r} is not a usable key name (letters, digits, '_', '.', '-')", file=sys.stderr)
            return 2
    if SERVER_KEY in names + args.client:
        print(f"hmp-keygen: {SERVER_KEY!r} is the job's server key, not a node or client name", file=sys.stderr)
        return 2
    folder = Path(args.dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        written, kept = [], []
        for n in wanted:
            public, secret = folder / f"{n}.key", folder / f"{n}.key_secret"
            if (public.exists() or secret.exists()) and not args.force:
                kept.append(n)
                continue
            for p in (public, secret):
                p.unlink(missing_ok=True)
            create_certificates(folder, n)
            os.chmod(secret, 0o600)
            written.append(n)
    except OSError as exc:
        print(f"hmp-keygen: cannot write keys into {folder}: {exc}", file=sys.stderr)
        return 2
    print(f"hmp-keygen: {folder}: wrote {', '.join(written) or 'nothing'}"
          + (f"; kept existing {', '.join(kept)} (--force replaces them)" if kept else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
