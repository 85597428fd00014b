"""S3 as every part of the project meets it: its URIs (`parse_s3_uri`, and where a prefix is copied under the cache
dir, `local_target`), where it is and who we are, as AWS's own tools read it (the endpoint: AWS_ENDPOINT_URL_S3,
else AWS_ENDPOINT_URL, keys in its URL taken as credentials; the keys in the environment, else botocore's
credential chain: profiles, SSO, the container's and the instance's roles, one session per process and
setting; a bucket's region), boto3 clients for what the transfer engine does not do, and every failure in plain
words (`explain`: the bucket, the key and the fix, never a secret).
"""
from __future__ import annotations

import functools
import os
import re
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from .errors import UserError
from .redact import redact
from .tsv import MANIFEST_NAME
from .workdir import (
    is_disk_full,
)

NO_CREDENTIALS = "no AWS credentials were found"


class TransferError(Exception):
    """An S3 request failed; `code` is S3's error code (NoSuchKey, AccessDenied, SlowDown, ...) or ours:
    'timeout', 'connect', 'credentials', 'size' (the object's bytes differ from its listed size), 'http'."""

    def __init__(self, code: str, detail: str, status: int | None = None, server_time: str | None = None):
        super().__init__(detail)
        self.code, self.detail, self.status = code, detail, status
        self.server_time = server_time  # S3's clock, where it answered RequestTimeTooSkewed with it


class EndpointError(UserError):
    """AWS_ENDPOINT_URL(_S3) is not a URL S3 requests can be made below; the message names it and the fix."""


def _endpoint_setting() -> tuple[str, str | None]:
    """(the variable's name, its value): AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL (botocore's order)."""
    name = "AWS_ENDPOINT_URL_S3" if os.environ.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL"
    return name, os.environ.get(name) or None


def endpoint_url() -> str | None:
    """AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL (botocore's order), as set (credentials and all). One with a
    query or a fragment is refused: the bucket and key are added after the URL, so they landed in the query
    and an S3 server answered another request (moto: its bucket list, read as the first line of dataset.tsv)."""
    name, url = _endpoint_setting()
    if url and ("?" in url or "#" in url):
        u = urlsplit(url)
        raise EndpointError(f"{name}={redact(url)} has a {'query' if '?' in url else 'fragment'} "
                            f"({'?' if '?' in url else '#'}...): the bucket and key are added after the endpoint, so "
                            "they would land in it and S3 would answer another request; set it to the server alone, "
                            f"{u.scheme}://{redact(u.netloc.rsplit('@', 1)[-1])}{u.path.rstrip('/')}")
    return url


def endpoint_credentials() -> dict:
    """An AWS_ENDPOINT_URL(_S3) of the form http://KEY:SECRET@host:port: the endpoint without them, and
    them as the access key and secret (botocore would send them in the Host header otherwise)."""
    url = endpoint_url()
    if not url or "@" not in url:
        return {}
    u = urlsplit(url)
    if u.username is None:
        return {}
    return {"endpoint_url": urlunsplit(u._replace(netloc=u.netloc.rsplit("@", 1)[1])),
            "aws_access_key_id": unquote(u.username), "aws_secret_access_key": unquote(u.password or "")}


def endpoint() -> str:
    """The endpoint S3 requests go to (AWS_ENDPOINT_URL_S3 before AWS_ENDPOINT_URL), redacted."""
    return redact(_endpoint_setting()[1] or "the AWS S3 endpoint")


def env_keys() -> tuple[str, str, str | None] | None:
    """The credentials in AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN (or the older
    AWS_SECURITY_TOKEN): (key, secret, token), read as botocore's first provider reads them, which wins
    over every other (AWS_PROFILE too) and is never refreshed. None when they are absent or incomplete, or
    AWS_CREDENTIAL_EXPIRATION makes them expire: then botocore's chain decides (and names what is wrong).
    Read here because importing botocore and walking its chain costs about 0.2 s per sync."""
    env = os.environ
    if not env.get("AWS_ACCESS_KEY_ID") or not env.get("AWS_SECRET_ACCESS_KEY") or env.get("AWS_CREDENTIAL_EXPIRATION"):
        return None
    token = env.get("AWS_SECURITY_TOKEN") or env.get("AWS_SESSION_TOKEN") or None
    return env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], token


_botocore_lock = threading.Lock()


_botocore: dict = {}  # {what the chain reads (the AWS_* environment, HOME, the profile files' stat): a session}


def botocore_session():
    """One botocore session per process and AWS setting (botocore alone: boto3 would import s3transfer
    too); a changed AWS_* variable or HOME, or an edited ~/.aws/credentials or config, makes a new one,
    as a new process would (a session keeps the credentials it found)."""
    import botocore.session

    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_") or k == "HOME"))
    files = []
    for var, default in (("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"), ("AWS_CONFIG_FILE", "~/.aws/config")):
        try:
            st = os.stat(os.path.expanduser(os.environ.get(var) or default))
            files.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            files.append(None)
    key = (env, tuple(files))
    with _botocore_lock:
        if key not in _botocore:
            _botocore.clear()
            _botocore[key] = botocore.session.get_session()
        return _botocore[key]


def from_botocore(ask):
    """`ask(session)` of botocore's session; what botocore refuses (a key without its secret, a profile that is
    not there, an unreadable expiry) as a TransferError('credentials') naming it."""
    from botocore.exceptions import BotoCoreError

    try:
        return ask(botocore_session())
    except (BotoCoreError, ValueError) as e:
        raise TransferError("credentials", redact(str(e))[:300]) from None


def botocore_credentials():
    """botocore's credential chain, walked once per session (the session keeps what it found: an instance
    role's credentials are fetched once, then refreshed by botocore as they expire)."""
    creds = from_botocore(lambda session: session.get_credentials())
    if creds is None:
        raise TransferError("credentials", NO_CREDENTIALS)
    return creds


def bucket_region(session, bucket: str) -> str | None:
    """The region of an AWS bucket (botocore follows S3's redirect), or None when it cannot be told."""
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client = session.create_client("s3", config=Config(connect_timeout=5, read_timeout=20, retries={"max_attempts": 2}))
        head = client.head_bucket(Bucket=bucket)
        return head.get("BucketRegion") or head["ResponseMetadata"]["HTTPHeaders"].get("x-amz-bucket-region")
    except ClientError as e:
        return e.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
    except BotoCoreError:
        return None


@dataclass(frozen=True)
class Bounds:
    """The timeouts and retries of one kind of transfer, one value handed down to what makes its requests (the
    engine: the first three, for S3 and http(s):// objects alike; a whole-object fetch above it: the rest).
    Retries stack two deep at most: the engine's per request (throttling, cut and stalled bodies), and
    `attempts` whole objects above them. Tests pass their own (a silent endpoint named in seconds), never patch
    constants."""
    connect_timeout: float = 5.0  # seconds to connect
    read_timeout: float = 10.0  # seconds without a byte after which a request is retried
    request_attempts: int = 3  # tries of one request, inside one attempt
    attempts: int = 2  # whole-object attempts
    stall: float = 30.0  # seconds without a byte after which an attempt is cancelled (a silent endpoint: 2 x this)
    attempt_deadline: float = 120.0  # seconds an attempt may take at most, plus the time of its bytes at min_rate
    min_rate: float = 2e6  # bytes/s: the slowest transfer an attempt is given time for

    def deadline(self, size: int | None) -> float:
        """Seconds one attempt at an object of `size` bytes may take."""
        return self.attempt_deadline + (size or 0) / self.min_rate


SYNC_BOUNDS = Bounds(connect_timeout=5.0, read_timeout=20.0, request_attempts=3, stall=40.0)  # a sync's: one
# request ends within about 5 + 3 x 20 s; the whole sync stops after `stall` seconds without a byte from any request


class SyncError(UserError):
    """The sync cannot proceed; the message names the bucket/key/row and what to do."""


class ManifestMissing(SyncError):
    """The prefix holds no dataset.tsv (it may be a pack: the sync command then fetches that)."""


def parse_s3_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise SyncError(f"{redact(uri)!r} is not an s3:// URI; use s3://bucket/prefix")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise SyncError(f"{redact(uri)!r} names no bucket; use s3://bucket/prefix")
    return bucket, prefix.strip("/")


def local_target(uri: str, cache_dir: Path) -> Path:
    """Where `uri` is synced under the cache dir: CACHE/s3/BUCKET/PREFIX. A bucket or prefix segment that is no
    folder name ("..", ".", an empty one from "//") is refused: S3 takes it as part of a key, but here it made
    the copy land outside CACHE/s3/BUCKET (`s3://b/../../x` at CACHE/x) or share another prefix's folder."""
    bucket, prefix = parse_s3_uri(uri)
    odd = [seg for seg in [bucket] + (prefix.split("/") if prefix else []) if seg in ("", ".", "..")]
    if odd:
        raise SyncError(f"{redact(uri)!r}: its bucket or prefix holds a {odd[0]!r} segment, which no local folder "
                        "can stand for; name the prefix without '.', '..' and '//' segments")
    return Path(cache_dir) / "s3" / bucket / prefix


def make_client(workers: int, bounds: Bounds = SYNC_BOUNDS):
    """An S3 client for `workers` threads; timeouts and tries default to this module's bounds."""
    import boto3
    from botocore.config import Config

    cfg = Config(max_pool_connections=max(10, workers), connect_timeout=bounds.connect_timeout,
                 read_timeout=bounds.read_timeout, tcp_keepalive=True,
                 retries={"max_attempts": bounds.request_attempts, "mode": "standard"})
    return boto3.session.Session().client("s3", config=cfg, **endpoint_credentials())


def explain(err: Exception, bucket: str, key: str) -> str:
    """A message for a failed S3 call (boto3's, or the transfer engine's TransferError) that names the
    bucket/key and the fix, never a secret."""
    if isinstance(err, OSError) and is_disk_full(err):
        return f"no space left on the local disk for s3://{bucket}/{key}"
    code = _code(err)
    if code == "credentials":
        found = f" ({err.detail})" if isinstance(err, TransferError) and err.detail != NO_CREDENTIALS else ""
        return (f"no usable AWS credentials{found}. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
                "or run with an instance/SageMaker role that can read the bucket")
    if code == "timeout":
        return (f"{endpoint()} did not answer for s3://{bucket}/{key} (timed out after {SYNC_BOUNDS.request_attempts} tries); "
                "check AWS_ENDPOINT_URL, the region and the network")
    if code == "connect":
        return f"cannot reach {endpoint()}; check AWS_ENDPOINT_URL, the region and the network"
    if code == "NoSuchBucket":
        return f"bucket {bucket!r} does not exist (or is in another account/endpoint); check the s3:// URI"
    if code in ("NoSuchKey", "404", "NotFound"):
        return f"s3://{bucket}/{key} does not exist; check the prefix (it must hold {MANIFEST_NAME})"
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return f"access to s3://{bucket}/{key} was denied ({code}); check the credentials and the bucket policy"
    if code in ("SlowDown", "503"):
        return (f"{endpoint()} kept throttling s3://{bucket}/{key} (503 SlowDown, {SYNC_BOUNDS.request_attempts} tries); rerun "
                "later or with fewer --workers")
    if code == "size":
        return f"s3://{bucket}/{key}: {err}; rerun the sync (the object may be changing)"
    if code in ("PermanentRedirect", "301", "AuthorizationHeaderMalformed"):
        region = region_of(bucket, endpoint())
        fix = (f"find its region (aws s3api head-bucket --bucket {bucket}: BucketRegion) and set AWS_DEFAULT_REGION "
               "to it" if not region else f"S3 says it is in {region}, as AWS_DEFAULT_REGION says" if region ==
               os.environ.get("AWS_DEFAULT_REGION") else f"it is in {region}: set AWS_DEFAULT_REGION={region}")
        if _endpoint_setting()[1]:
            fix += f", and {_endpoint_setting()[0]} to an endpoint of that region (or leave it unset for AWS)"
        return (f"s3://{bucket}/{key}: S3 answered {code} (bucket {bucket!r} is in another region than the one "
                f"{endpoint()} was asked in); {fix}")
    if code == "RequestTimeTooSkewed":
        return (f"{endpoint()} refused s3://{bucket}/{key} (RequestTimeTooSkewed): this machine's clock is more than "
                f"15 minutes off S3's{clocks(err)}, and S3 refuses requests signed at another time; set the clock "
                "(timedatectl set-ntp true, or chronyd/ntpd), then rerun")
    if code == "endpoint":
        return str(err)
    if code == "BadKey":
        return (f"s3://{bucket}/{key!r}: the key holds a control character (a tab, a line break), which the transfer "
                "engine (object_store) cannot request; rename the object without it")
    if code is not None:
        return f"S3 error {code} on s3://{bucket}/{key}"
    return f"{type(err).__name__} on s3://{bucket}/{key}: " + redact(str(err))[:200]  # redacted whole, then cut


@functools.lru_cache(maxsize=16)
def region_of(bucket: str, endpoint: str) -> str | None:
    """The region S3 says `bucket` is in (one HEAD through botocore, asked once per bucket and endpoint), or None."""
    try:
        return from_botocore(lambda session: bucket_region(session, bucket))
    except TransferError:
        return None


def clocks(err: Exception) -> str:
    """' (S3's clock: T, this machine's: T2)' where S3 said its time (RequestTimeTooSkewed), else ''."""
    said = getattr(err, "server_time", None)
    if said is None and type(err).__module__.startswith("botocore"):
        said = getattr(err, "response", {}).get("Error", {}).get("ServerTime")
    try:
        server = datetime.fromisoformat(str(said).replace("Z", "+00:00"))
    except ValueError:
        return ""
    now = datetime.now(timezone.utc)
    if server.tzinfo is None:
        server = server.replace(tzinfo=timezone.utc)
    minutes = round(abs((now - server).total_seconds()) / 60)
    return (f" (S3's clock said {server:%Y-%m-%d %H:%M:%S} UTC, this machine's {now:%Y-%m-%d %H:%M:%S} UTC: "
            f"{minutes} minutes apart)")


def _code(err: Exception) -> str | None:
    """What went wrong, in the transfer engine's words (TransferError.code), whoever raised it."""
    if isinstance(err, TransferError):
        return err.code
    if type(err).__module__.startswith("botocore"):
        from botocore.exceptions import (
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
            ReadTimeoutError,
        )

        if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
            return "credentials"
        if isinstance(err, (ReadTimeoutError, ConnectTimeoutError)):
            return "timeout"
        if isinstance(err, EndpointConnectionError):
            return "connect"
        if isinstance(err, ClientError):
            return err.response.get("Error", {}).get("Code") or "?"
    return None


def list_with_boto3(bucket: str, prefix: str, *, connect_timeout: float, read_timeout: float,
                    attempts: int) -> dict[str, tuple[int, str]]:
    """The listing for a prefix holding keys that object_store refuses (boto3's paginator)."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    given = endpoint_credentials()
    client = boto3.session.Session().client(
        "s3", config=Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                            retries={"max_attempts": attempts, "mode": "standard"}), **given)
    found: dict[str, tuple[int, str]] = {}
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                found[obj["Key"][len(prefix):]] = (obj["Size"], obj["ETag"].strip('"'))
    except ClientError as e:
        raise TransferError(e.response.get("Error", {}).get("Code", "http"), redact(str(e))[:300]) from None
    except BotoCoreError as e:
        raise TransferError("timeout" if "timeout" in type(e).__name__.lower() else "connect",
                            redact(str(e))[:300]) from None
    return found


def engine_refuses(key: str) -> bool:
    """A key the transfer engine cannot request: object_store refuses ASCII control characters in a path (a tab,
    a line break), before any request."""
    return re.search(r"[\x00-\x1f\x7f]", key) is not None


def classify(err: BaseException) -> TransferError:
    """obstore's error (its text carries S3's XML error and reqwest's kind) as a TransferError."""
    if isinstance(err, TransferError):
        return err
    if isinstance(err, EndpointError):  # raised where the store is made: its message is the whole story
        return TransferError("endpoint", str(err))
    text = str(err)
    code = re.search(r"<Code>([A-Za-z0-9.]+)</Code>", text)
    status = re.search(r"status code: (\d{3})", text)
    st = int(status.group(1)) if status else None
    first = redact(text.split("\n", 1)[0])[:300]  # redacted whole: a cut could split a secret from its marker
    if code:
        server = re.search(r"<ServerTime>([^<]{1,40})</ServerTime>", text)
        return TransferError(code.group(1), first, st, server.group(1) if server else None)
    if st == 301 or "redirect without LOCATION" in text:  # S3's PermanentRedirect (obstore drops its body)
        return TransferError("PermanentRedirect", first, 301)
    if "Could not parse path" in text and "illegal character" in text:  # a key object_store refuses
        return TransferError("BadKey", first)
    if isinstance(err, FileNotFoundError) or st == 404:
        return TransferError("NoSuchKey", first, 404)
    if st in (401, 403) or type(err).__name__ in ("PermissionDeniedError", "UnauthenticatedError"):
        return TransferError("AccessDenied", first, st)
    if st is not None:
        return TransferError(f"HTTP {st}", first, st)
    if "non-partial response" in text:  # a server that answers a ranged GET with 200 (rclone's serve s3)
        return TransferError("NotPartial", first)
    if "kind: Timeout" in text or "TimedOut" in text or "timed out" in text:
        return TransferError("timeout", first)
    if "kind: Connect" in text or "Connection refused" in text or "dns error" in text:
        return TransferError("connect", first)
    return TransferError("http", first)
