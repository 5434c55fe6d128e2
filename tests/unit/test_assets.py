"""kvcalib.assets without the network: registries, pip failures, hash checks, GGUF assembly.

pip is replaced by a fake that writes archives built in tmp_path; KVCALIB_HOME points at
tmp_path so nothing touches the real cache.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from kvcalib import assets
from kvcalib.assets import (DISTRIBUTIONS, EMBEDDED_MODELS, EMBEDDED_TEXTS, ArchiveMember,
                            EmbeddedModel, PinnedDist, embedded_model_gguf, fetch_distribution)
from kvcalib.errors import KvcalibError

HEX64 = re.compile(r"[0-9a-f]{64}")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVCALIB_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _wheel_bytes(tmp: Path, name: str, members: dict[str, bytes]) -> Path:
    path = tmp / name
    with zipfile.ZipFile(path, "w") as zf:
        for member, payload in members.items():
            zf.writestr(member, payload)
    return path


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _fake_pip(monkeypatch, sources: dict[str, Path], calls: list[str]):
    """subprocess.run stand-in: copies sources[requirement] into the -d folder."""

    def run(cmd, capture_output, text):
        req = cmd[-1]
        calls.append(req)
        assert "--no-deps" in cmd and "download" in cmd and "install" not in cmd
        if req not in sources:
            err = f"WARNING: x\nERROR: No matching distribution found for {req}\n"
            return subprocess.CompletedProcess(cmd, 1, "", err)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / sources[req].name).write_bytes(sources[req].read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "Saved\n", "")

    monkeypatch.setattr(assets.subprocess, "run", run)


# --------------------------------------------------------------------------------------------
# registries
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alias", sorted(EMBEDDED_MODELS))
def test_model_registry_consistent(alias):
    m = EMBEDDED_MODELS[alias]
    assert m.alias == alias and m.gguf_filename.endswith(".gguf")
    assert m.licence and m.architecture and m.parts
    assert HEX64.fullmatch(m.sha256) or (alias == "qwen2.5-coder-1.5b" and m.sha256 == "cc324af0")
    for d in m.packages:
        assert DISTRIBUTIONS[d.requirement] is d
        assert d.sha256 is None or HEX64.fullmatch(d.sha256)
    assert m.packages[0] is m.parts[0].dist  # parts first, in join order


def test_known_prefixes_and_sizes():
    assert EMBEDDED_MODELS["qwen2.5-coder-0.5b"].sha256.startswith("1d961463")
    assert len(EMBEDDED_MODELS["qwen2.5-coder-1.5b"].parts) == 22
    assert EMBEDDED_MODELS["gemma3-270m"].parts[-1].member.endswith(".part03")


def test_text_registry_consistent():
    plays = {f"play-{name}" for name, _, _ in assets.PLAYS}
    punkt = {f"punkt_tab/{file}" for file, _ in assets.PUNKT_TAB}
    assert set(EMBEDDED_TEXTS) == {"boolq-test", "boolq-dev", "gsm8k-100", "britannica", "paradise-lost",
                                   "areopagitica", *plays, *punkt}
    assert len(plays) == 8 and "punkt_tab/english/sent_starters.txt" in punkt
    for t in EMBEDDED_TEXTS.values():
        assert HEX64.fullmatch(t.sha256) and t.licence and t.attribution
        assert DISTRIBUTIONS[t.source.dist.requirement] is t.source.dist


def test_unknown_names():
    with pytest.raises(KvcalibError, match="choose one of: smollm2-135m"):
        embedded_model_gguf("llama-7b")
    with pytest.raises(KvcalibError, match="boolq-test"):
        assets.embedded_text_file("wikitext")


# --------------------------------------------------------------------------------------------
# download
# --------------------------------------------------------------------------------------------


def test_pip_failure_names_package_and_error(home, monkeypatch):
    _fake_pip(monkeypatch, {}, [])
    dist = PinnedDist("no-such-pkg", "1.0", "no_such_pkg-1.0-py3-none-any.whl", None)
    with pytest.raises(KvcalibError) as info:
        fetch_distribution(dist)
    msg = str(info.value)
    assert "no-such-pkg==1.0" in msg and "No matching distribution found" in msg
    assert "PyPI" in msg and "WARNING" not in msg
    assert not list((home / "downloads").iterdir())  # no temporaries left


def test_download_hash_checked_and_reused(home, tmp_path, monkeypatch):
    src = _wheel_bytes(tmp_path, "pkg-1.0-py3-none-any.whl", {"pkg/a.bin": b"abc"})
    good = PinnedDist("pkg", "1.0", src.name, _sha(src.read_bytes()))
    bad = PinnedDist("pkg", "1.0", src.name, "0" * 64)
    calls: list[str] = []
    _fake_pip(monkeypatch, {"pkg==1.0": src}, calls)

    with pytest.raises(KvcalibError, match="sha256 of .* expected 0000"):
        fetch_distribution(bad)
    assert not list((home / "downloads").iterdir())  # the bad file never lands

    path = fetch_distribution(good)
    assert path == home / "downloads" / src.name and path.read_bytes() == src.read_bytes()
    assert fetch_distribution(good) == path and calls == ["pkg==1.0", "pkg==1.0"]  # reused

    path.write_bytes(b"tampered")
    with pytest.raises(KvcalibError, match="Delete .* and run again"):
        fetch_distribution(good)


# --------------------------------------------------------------------------------------------
# assembly
# --------------------------------------------------------------------------------------------


def _fake_model(tmp_path, monkeypatch, sha256: str | None = None
                ) -> tuple[EmbeddedModel, bytes, list[str]]:
    chunks = [b"GGUF" + bytes(range(50)), b"\x01" * 3000, b"tail"]
    parts, sources = [], {}
    for i, chunk in enumerate(chunks, 1):
        members = {f"fake_part{i}/data/part{i:02d}.bin": chunk, f"fake_part{i}/__init__.py": b""}
        wheel = _wheel_bytes(tmp_path, f"fake_part{i}-1.0-py3-none-any.whl", members)
        dist = PinnedDist(f"fake-part{i}", "1.0", wheel.name, _sha(wheel.read_bytes()))
        parts.append(ArchiveMember(dist, f"fake_part{i}/data/part{i:02d}.bin"))
        sources[dist.requirement] = wheel
    joined = b"".join(chunks)
    model = EmbeddedModel(
        alias="fake", parts=tuple(parts), gguf_filename="fake.gguf",
        sha256=sha256 if sha256 is not None else _sha(joined),
        licence="test", architecture="none",
        notices=(ArchiveMember(parts[0].dist, "fake_part1/__init__.py"),),
    )
    monkeypatch.setitem(EMBEDDED_MODELS, "fake", model)
    calls: list[str] = []
    _fake_pip(monkeypatch, sources, calls)
    return model, joined, calls


def test_assemble_joins_in_order_and_stamps(home, tmp_path, monkeypatch):
    model, joined, calls = _fake_model(tmp_path, monkeypatch)
    path = embedded_model_gguf("fake")
    assert path == home / "models" / "fake" / "fake.gguf"
    assert path.read_bytes() == joined
    assert (path.parent / "ATTRIBUTION.txt").read_text().count("fake-part") == 3
    assert (path.parent / "__init__.py").is_file()  # notice copied beside the GGUF
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "ATTRIBUTION.txt", "__init__.py", "fake.gguf", "fake.gguf.sha256.json"]
    assert calls == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]

    # second call: stamp matches, no hashing, no download
    monkeypatch.setattr(assets, "sha256_file", lambda p: pytest.fail("re-hashed"))
    assert embedded_model_gguf("fake") == path and len(calls) == 3


def test_assemble_rebuilds_corrupt_file(home, tmp_path, monkeypatch):
    model, joined, calls = _fake_model(tmp_path, monkeypatch)
    path = embedded_model_gguf("fake")
    path.write_bytes(b"corrupt")  # size and mtime change: the stamp no longer matches
    assert embedded_model_gguf("fake").read_bytes() == joined


def test_assemble_prefix_hash(home, tmp_path, monkeypatch):
    chunks_sha = _fake_model(tmp_path, monkeypatch)[0].sha256
    _fake_model(tmp_path, monkeypatch, sha256=chunks_sha[:8])
    assert embedded_model_gguf("fake").is_file()


def test_assemble_hash_mismatch_leaves_nothing(home, tmp_path, monkeypatch):
    _fake_model(tmp_path, monkeypatch, sha256="f" * 64)
    with pytest.raises(KvcalibError, match="assembled fake.gguf.*Delete the fake archives"):
        embedded_model_gguf("fake")
    folder = home / "models" / "fake"
    assert not any(folder.iterdir())  # no final file, no temporaries
