"""Which code a result came from: the checkout's git commit and a digest of the plugin's files.

The GPU machine gets a copy of the working tree whose git metadata can lag the tree itself (the
serving run of 2026-12-02 recorded the parent of the commit it ran: docs/performance-history.md), so a
commit id alone does not say which plugin ran. ``package_sha256`` hashes the files that make up
the package (every file under ``vllm_mla_fusion/`` but Python's caches), computed the same way
from a directory and from a commit, so a result's digest names its commit:

    python -m benchmarks.provenance                 # this checkout's commit, dirtiness and digest
    python -m benchmarks.provenance --commits 30    # the digest of each of the last 30 commits
    python -m benchmarks.provenance --find DIGEST   # the commits whose package has that digest
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "vllm_mla_fusion"


def _kept(relative: str) -> bool:
    """A package file, not a cache Python or a build left beside it."""
    parts = relative.split("/")
    return "__pycache__" not in parts and not relative.endswith((".pyc", ".pyo"))


def _digest(files: list[tuple[str, bytes]]) -> str:
    """sha256 over (path, size, content) of each file, in path order: a renamed, added or emptied
    file changes it as much as an edited one."""
    h = hashlib.sha256()
    for path, data in sorted(files):
        h.update(path.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def package_sha256(package_dir: Path) -> str | None:
    """The digest of the package at ``package_dir`` (a ``vllm_mla_fusion/`` directory); None if absent."""
    package_dir = Path(package_dir)
    if not package_dir.is_dir():
        return None
    files = [(p.relative_to(package_dir).as_posix(), p.read_bytes()) for p in package_dir.rglob("*") if p.is_file()]
    return _digest([(path, data) for path, data in files if _kept(path)])


def _git(repo: Path, *args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], input=data, capture_output=True, check=True, timeout=60).stdout


def commit_package_sha256(commit: str, repo: Path = REPO) -> str | None:
    """The digest of the package as commit ``commit`` holds it (None where it holds none)."""
    listing = _git(repo, "ls-tree", "-r", "-z", commit, "--", f"{PACKAGE}/").decode()
    blobs = []
    for entry in filter(None, listing.split("\0")):
        meta, path = entry.split("\t", 1)
        relative = path[len(PACKAGE) + 1 :]
        if meta.split()[1] == "blob" and _kept(relative):
            blobs.append((relative, meta.split()[2]))
    if not blobs:
        return None
    # One `git cat-file --batch` for all blobs: "<sha> blob <size>\n<content>\n" each.
    out = _git(repo, "cat-file", "--batch", data="".join(f"{sha}\n" for _, sha in blobs).encode())
    files, pos = [], 0
    for relative, _ in blobs:
        header_end = out.index(b"\n", pos)
        size = int(out[pos:header_end].split()[2])
        files.append((relative, out[header_end + 1 : header_end + 1 + size]))
        pos = header_end + 1 + size + 1
    return _digest(files)


def source_facts(repo: Path = REPO) -> dict:
    """``git_commit`` (HEAD, or None without git), ``git_dirty`` and ``package_sha256`` of the
    package in ``repo``: what a result's JSON records about the code that produced it."""
    facts: dict = {"git_commit": None, "git_dirty": None, "package_sha256": package_sha256(repo / PACKAGE)}
    try:
        facts["git_commit"] = _git(repo, "rev-parse", "HEAD").decode().strip() or None
        facts["git_dirty"] = bool(_git(repo, "status", "--porcelain").strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return facts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commits", type=int, default=0, help="also list the digest of the last N commits")
    ap.add_argument("--find", metavar="DIGEST", help="the commits (of the last --commits, default 200) with this digest")
    a = ap.parse_args(argv)
    facts = source_facts()
    print(f"checkout: commit {facts['git_commit']}{' (dirty)' if facts['git_dirty'] else ''}, "
          f"package_sha256 {facts['package_sha256']}")  # fmt: skip
    n = a.commits or (200 if a.find else 0)
    if not n:
        return 0
    found = []
    for line in _git(REPO, "log", f"-{n}", "--format=%H %s").decode().splitlines():
        commit, _, subject = line.partition(" ")
        digest = commit_package_sha256(commit)
        if a.find:
            if digest == a.find:
                found.append(commit)
                print(f"{commit} {subject[:80]}")
        else:
            print(f"{commit[:12]} {digest} {subject[:60]}")
    if a.find and not found:
        print(f"no commit of the last {n} has package_sha256 {a.find}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
