"""Run mypy on kvmesh under its installed module names.

pyproject maps each folder into the one namespace (`gateway/` is `kvmesh.gateway`, `protos/kvmesh`
is `kvmesh.protos`), which mypy cannot read: it names modules after their place on disk. This
lays out a tree of links as the wheel is (`kvmesh/gateway -> <repo>/gateway`, ...), runs mypy
there with the repo's configuration ([tool.mypy]'s `files` name paths in that tree) and prints
its findings with the repo's own paths.

mypy's cache lives in kvmesh's cache folder on this machine (`kvmesh.cache_root()/mypy`), shared
by every clone as the compiled kernels are: a fresh clone's check reads the modules it has seen
before (mypy checks each by its source's hash: a file changed since is checked again) and takes
~2 s, not the ~40 s of a cold cache.

Run: `python scripts/typecheck.py [mypy flags]` (`make test` runs it); exits with mypy's status.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs() -> dict[str, Path]:
    """Sub-package name -> its folder, from pyproject's [tool.setuptools.package-dir]."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: ROOT / folder for name, folder in config["tool"]["setuptools"]["package-dir"].items()}


def link_tree(tree: Path) -> dict[Path, Path]:
    """Lay out `tree` as the wheel is, with links to the repo's files; return link -> target
    (to translate paths back)."""
    links = {}
    for name, folder in package_dirs().items():
        where = tree.joinpath(*name.split("."))
        if name == "kvmesh":  # the app's own folder: its entries, beside the mapped folders
            where.mkdir(parents=True, exist_ok=True)
            for entry in folder.iterdir():
                if entry.name != "__pycache__":
                    links[where / entry.name] = entry
        else:
            links[where] = folder
    for link, target in links.items():
        if link.is_symlink() and link.resolve() == target:
            continue
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target, target_is_directory=target.is_dir())
    for entry in (tree / "kvmesh").iterdir():  # a file deleted from the repo
        if entry.is_symlink() and not entry.exists():
            entry.unlink()
    return links


def main() -> int:
    from kvmesh import cache_root

    tree = Path(tempfile.gettempdir()) / f"kvmesh-typecheck-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]}"
    links = link_tree(tree)
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--cache-dir",
        str(cache_root() / "mypy"),
        *sys.argv[1:],
    ]
    out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env={**os.environ, "MYPYPATH": ""})
    text = out.stdout + out.stderr
    # longest link first: kvmesh/engine before kvmesh
    for link, target in sorted(links.items(), key=lambda item: -len(str(item[0]))):
        text = text.replace(str(link.relative_to(tree)) + "/", str(target.relative_to(ROOT)) + "/")
        text = text.replace(str(link.relative_to(tree)) + ":", str(target.relative_to(ROOT)) + ":")
    print(text, end="")
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())
