"""Object storage as the hand-off between stages, nodes and the server.

`workdir: s3://bucket/prefix` (or gs://, abfss://, any fsspec scheme): each stage works
in a node-local scratch dir, publishes its output to the store with a manifest written
last, and downstream stages (on any node) fetch what they read into a checksum-verified,
bounded node-local cache. See uri.py (why fsspec), store.py (manifest, cache),
ranged.py (a release read by byte ranges into a sparse copy, for convert) and
preflight.py (the one-line checks before anything starts).
"""

from moeflow.core.storage.preflight import check_readable, check_writable
from moeflow.core.storage.store import (
           MANIFEST,
           adopt,
           cache_root,
           evict,
           fetch,
           localize,
           publish,
           published,
           read_manifest,
           scratch_root,
)
from moeflow.core.storage.uri import (
           check_location,
           exists,
           filesystem,
           fingerprint,
           is_uri,
           join,
           pyarrow_filesystem,
           read_text,
           remove,
           write_text,
)

__all__ = ["MANIFEST", "adopt", "cache_root", "check_location", "check_readable", "check_writable",
           "evict", "exists", "fetch", "filesystem", "fingerprint", "is_uri", "join", "localize", "publish",
           "published", "pyarrow_filesystem", "read_manifest", "read_text", "remove",
           "scratch_root", "write_text"]
