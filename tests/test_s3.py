"""S3's failures in plain words, against moto's server on 127.0.0.1 and the fault proxy in front of it: a bucket in
another region (301 PermanentRedirect) named with its region, a skewed clock with the fix, a key the transfer
engine cannot request left out by name, and an endpoint URL with a query refused before any request."""
from __future__ import annotations

import pytest

from dali_pipe.errors import UserError
from dali_pipe.imagefolder import sync_image_folder
from dali_pipe.s3 import SyncError, make_client
from dali_pipe.sync import sync


def _upload(photo_root, tab_key: bool = False):
    client = make_client(4)
    client.create_bucket(Bucket="data")
    client.put_object(Bucket="data", Key="ds/dataset.tsv", Body=(photo_root / "dataset.tsv").read_bytes())
    photos = sorted(photo_root.glob("*/*.jpg"))
    for p in photos:
        client.put_object(Bucket="data", Key=f"ds/{p.parent.name}/{p.name}", Body=p.read_bytes())
    if tab_key:
        client.put_object(Bucket="data", Key="ds/coffee/tab\there.jpg", Body=photos[0].read_bytes())
    return len(photos)


@pytest.fixture
def proxy(s3, photo_root, monkeypatch):
    """The photos uploaded (straight to moto), then the fault proxy in front of it as the endpoint."""
    from faultproxy import FaultProxy

    _upload(photo_root)
    made = FaultProxy(s3[1]).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", made.url)
    yield made
    made.stop()


def test_a_bucket_in_another_region_is_named_with_its_region(photo_root, proxy, tmp_path):
    """S3's 301 PermanentRedirect (which obstore reports as a redirect without a Location) names the bucket's
    region, as S3 tells it, and the setting to change; it said 'S3 error http'."""
    proxy.arm("301", "/data", times=100, region="eu-west-1")
    with pytest.raises(SyncError, match=r"s3://data/ds/dataset.tsv: S3 answered PermanentRedirect \(bucket 'data' is "
                                        r"in another region.*it is in eu-west-1: set AWS_DEFAULT_REGION=eu-west-1"):
        sync("s3://data/ds", tmp_path / "L", workers=4, progress=False)


def test_a_skewed_clock_is_named_with_the_fix(photo_root, proxy, tmp_path):
    """RequestTimeTooSkewed says the clocks differ, by how much, and how to set this machine's; it said only
    'S3 error RequestTimeTooSkewed'."""
    proxy.arm("skew", "/data/ds/coffee/", times=100)
    with pytest.raises(SyncError) as e:
        sync("s3://data/ds", tmp_path / "L", workers=4, progress=False)
    said = str(e.value)
    assert "coffee/coffee_0000.jpg (RequestTimeTooSkewed): this machine's clock is more than 15 minutes off S3's" in said
    assert "S3's clock said 2020-01-01 00:20:00 UTC" in said and "timedatectl set-ntp true" in said


def test_a_key_with_a_tab_is_left_out_by_name_and_the_rest_synced(s3, photo_root, tmp_path, capsys):
    """An ImageFolder key holding a tab, which object_store cannot request, is named as not synced with the reason
    and the fix; the other images arrive and the sync succeeds (one such key failed the whole sync)."""
    n = _upload(photo_root, tab_key=True)
    stats, names = sync_image_folder("s3://data/ds", tmp_path / "L", workers=4, progress=False)
    assert stats.downloaded == n and len(names) == n and stats.unrequestable == ["coffee/tab\there.jpg"]
    err = capsys.readouterr().err
    assert "1 object(s) of s3://data/ds/ not synced, so not read: 'coffee/tab\\there.jpg'" in err
    assert "control character (a tab, a line break)" in err and "rename them in the bucket" in err


def test_an_endpoint_with_a_query_is_refused_naming_it(s3, photo_root, tmp_path, monkeypatch):
    """AWS_ENDPOINT_URL with a query put the bucket and key into it, and moto's bucket list was read as the first
    line of dataset.tsv ('no image_path column'); now the variable is named with the fix, its secrets redacted."""
    _upload(photo_root)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"{s3[1]}/?X-Amz-Signature=s3cr3tsig")
    with pytest.raises(UserError) as e:
        sync("s3://data/ds", tmp_path / "L", workers=4, progress=False)
    said = str(e.value)
    assert said.startswith("AWS_ENDPOINT_URL=") and "has a query" in said and f"set it to the server alone, {s3[1]}" in said
    assert "s3cr3tsig" not in said and "image_path" not in said
