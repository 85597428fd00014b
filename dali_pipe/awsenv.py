"""Where S3 is and who we are, as AWS's own tools read it: the endpoint (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL,
keys in its URL taken as credentials), the keys in the environment, else botocore's credential chain (profiles,
SSO, the container's and the instance's roles: one session per process and setting), a bucket's region; and
`TransferError`, what any S3 request here fails with.
"""
from __future__ import annotations

import os
import threading
from urllib.parse import unquote, urlsplit, urlunsplit

from .redact import redact

NO_CREDENTIALS = "no AWS credentials were found"


class TransferError(Exception):
    """An S3 request failed; `code` is S3's error code (NoSuchKey, AccessDenied, SlowDown, ...) or ours:
    'timeout', 'connect', 'credentials', 'size' (the object's bytes differ from its listed size), 'http'."""

    def __init__(self, code: str, detail: str, status: int | None = None):
        super().__init__(detail)
        self.code, self.detail, self.status = code, detail, status


def endpoint_url() -> str | None:
    """AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL (botocore's order), as set (credentials and all)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


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
    return redact(endpoint_url() or "the AWS S3 endpoint")


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
