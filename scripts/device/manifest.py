"""The manifest of the files the device acceptance kit carries (scripts/device/wheels.sh), and its size check.

    python scripts/device/manifest.py FOLDER --call main=core,peer,fp8 --call ppo=core,ppo [--limit-mib 50]

FOLDER holds one sub-folder per group of files (core, peer, ...). Writes FOLDER/MANIFEST.tsv: one line per
file (group, path inside the group, bytes, sha256), then one line per call with the MiB it carries. A call
is the groups one device call names in its `carry`; each must stay under --limit-mib, since the device
tool carries at most 64 MiB a call, the working tree included. Exit status 1 when a call is over (the
MANIFEST is written all the same), 2 when a named group is missing.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

MIB = 1024 ** 2


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def entries(folder: Path) -> list[dict]:
    """Every file under FOLDER's group folders (MANIFEST.tsv aside), sorted by group and path."""
    return [{"group": group.name, "path": str(p.relative_to(group)), "bytes": p.stat().st_size, "sha256": sha256(p)}
            for group in sorted(d for d in folder.iterdir() if d.is_dir())
            for p in sorted(group.rglob("*")) if p.is_file()]


def call_sizes(files: list[dict], calls: dict[str, list[str]]) -> dict[str, int]:
    """Bytes each call carries: the files of its groups."""
    return {name: sum(f["bytes"] for f in files if f["group"] in groups) for name, groups in calls.items()}


def parse_call(text: str) -> tuple[str, list[str]]:
    name, sep, groups = text.partition("=")
    if not sep or not name or not groups:
        raise argparse.ArgumentTypeError(f"--call {text!r}: expected NAME=GROUP[,GROUP...]")
    return name, groups.split(",")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--call", type=parse_call, action="append", default=[], help="NAME=GROUP[,GROUP...]")
    parser.add_argument("--limit-mib", type=float, default=50.0)
    args = parser.parse_args(argv)
    calls = dict(args.call)
    groups = {d.name for d in args.folder.iterdir() if d.is_dir()} if args.folder.is_dir() else set()
    missing = sorted({g for gs in calls.values() for g in gs} - groups)
    if missing:
        print(f"error: no group folder {', '.join(missing)} under {args.folder}; run scripts/device/wheels.sh",
              file=sys.stderr)
        return 2
    files = entries(args.folder)
    sizes = call_sizes(files, calls)
    lines = ["group\tpath\tbytes\tsha256"] + [f"{f['group']}\t{f['path']}\t{f['bytes']}\t{f['sha256']}" for f in files]
    lines += [f"call\t{name}={','.join(calls[name])}\t{size}\t{size / MIB:.2f} MiB" for name, size in sizes.items()]
    (args.folder / "MANIFEST.tsv").write_text("\n".join(lines) + "\n")
    over = {name: size for name, size in sizes.items() if size > args.limit_mib * MIB}
    for name, size in sizes.items():
        print(f"call {name} (carry {', '.join(f'{args.folder}/{g}' for g in calls[name])}): {size / MIB:.2f} MiB"
              + (f"  OVER the {args.limit_mib:g} MiB limit" if name in over else ""))
    print(f"{len(files)} files, {sum(f['bytes'] for f in files) / MIB:.2f} MiB in all; {args.folder / 'MANIFEST.tsv'}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
