"""Fixtures of the bucket tests (`bucket_servers`): local S3 and GCS servers, a bucket each."""

from bucket_servers import gcs_endpoint, s3_endpoint, store  # noqa: F401 - fixtures
