"""benchmarks/provenance.py: the package digest, the same from a directory and from a commit."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks import provenance


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def repo(tmp_path):
    """A git repository holding a small vllm_mla_fusion/ package, committed once."""
    root = tmp_path / "repo"
    pkg = root / "vllm_mla_fusion"
    (pkg / "backends").mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "backends" / "triton.py").write_text("def f():\n    return 2\n")
    (root / "README.md").write_text("not the package\n")
    _git(tmp_path, "init", "-q", str(root))
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    return root


def test_the_digest_follows_the_package_files_only(repo):
    pkg = repo / "vllm_mla_fusion"
    first = provenance.package_sha256(pkg)
    assert len(first) == 64
    (repo / "README.md").write_text("edited\n")  # outside the package
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0cache")  # Python's cache
    assert provenance.package_sha256(pkg) == first
    (pkg / "backends" / "triton.py").write_text("def f():\n    return 3\n")
    edited = provenance.package_sha256(pkg)
    assert edited != first
    (pkg / "backends" / "triton.py").rename(pkg / "backends" / "triton2.py")  # same bytes, new name
    assert provenance.package_sha256(pkg) not in (first, edited)
    assert provenance.package_sha256(repo / "missing") is None


def test_a_commit_and_its_checkout_give_the_same_digest(repo):
    head = _git(repo, "rev-parse", "HEAD").strip()
    pkg = repo / "vllm_mla_fusion"
    assert provenance.commit_package_sha256(head, repo) == provenance.package_sha256(pkg)
    (pkg / "ops.py").write_text("Y = 2\n")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "second")
    second = _git(repo, "rev-parse", "HEAD").strip()
    assert provenance.commit_package_sha256(second, repo) == provenance.package_sha256(pkg)
    assert provenance.commit_package_sha256(head, repo) != provenance.commit_package_sha256(second, repo)
    facts = provenance.source_facts(repo)
    assert facts == {"git_commit": second, "git_dirty": False, "package_sha256": provenance.package_sha256(pkg)}
    (pkg / "ops.py").write_text("Y = 3\n")
    assert provenance.source_facts(repo)["git_dirty"] is True


def test_source_facts_without_git(tmp_path):
    pkg = tmp_path / "vllm_mla_fusion"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    facts = provenance.source_facts(tmp_path)
    assert facts["git_commit"] is None and facts["package_sha256"] == provenance.package_sha256(pkg)
